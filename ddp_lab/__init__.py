"""DDP Lab: the package behind the workbook: engine/ (start and run programs), lessons/ (one
module per topic), experiments/ (the programs lessons launch), and the tools check/, doctor/,
autopsy/, verify/, grade/ (each a `ddp-lab` subcommand). README.md, "Layout", maps it."""
__version__ = "0.1.0"
