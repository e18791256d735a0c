"""DDP Lab: the engine behind the workbook's notebooks."""
__version__ = "0.1.0"
