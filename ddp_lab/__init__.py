"""DDP Lab: the package behind the workbook: engine/ (start and run programs), lessons/ (one
module per topic), experiments/ (the programs lessons launch), and the tools check/, doctor/,
autopsy/, verify/, grade/ (each a `ddp-lab` subcommand). README.md, "Layout", maps it."""
__version__ = "0.1.0"

# The oldest torch each part runs on, as tried (docs/train_ddp.md, "Tested here"): the notebooks and
# this package use APIs of torch 2.14 and are tested on it (pyproject.toml says the same); the
# copyable scripts in scripts/ ran, every flag, on torch 2.4.1 and fail on 2.3 (scripts/train_ddp.py
# refuses older torch with that message). `ddp-lab doctor` checks the installed torch against both.
TORCH_FLOOR = (2, 14)
SCRIPTS_TORCH_FLOOR = (2, 4)
