"""Notebooks: the code cells read as one program (they share a namespace), magics set aside.

`!cmd` lines, `%%bash` cells and `%%writefile x.sh` cells go to the shell rules, `%%writefile x.py`
cells are checked as programs of their own; other line magics become `pass`; a cell that still
does not parse as Python is left out.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

MAGIC = re.compile(r"^(\s*)(?:([\w.\[\], ]+?)\s*=\s*)?(!!?|%%?)(\w*)(.*)$")
SHELL_CELLS = {"bash", "sh"}
PYTHON_CELLS = {"time", "timeit", "capture", "prun", "px", "debug", "python", "python3"}
SHELL_SUFFIXES = (".sh", ".bash", ".sbatch", ".slurm")


@dataclass
class Cells:
    python: list = field(default_factory=list)   # lines of every code cell that parses, in order
    where: list = field(default_factory=list)    # python line i+1 came from (cell, line in cell)
    shell: list = field(default_factory=list)    # (cell, first line, text, is a `!` line, column offset)
    written: list = field(default_factory=list)  # %%writefile x.py cells: (cell, first line in cell, text)
    skipped: list = field(default_factory=list)  # cells that are not Python even without magics


def read(text: str) -> Cells:
    """Split an .ipynb file's JSON text; raises ValueError when it is not a notebook."""
    try:
        nb = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"not a notebook ({e})") from None
    if isinstance(nb, dict) and "cells" not in nb and "worksheets" in nb:
        raise ValueError("nbformat 3 notebook: upgrade it with `jupyter nbconvert --to notebook --nbformat 4`")
    cells = nb.get("cells") if isinstance(nb, dict) else None
    if not isinstance(cells, list):
        raise ValueError("not a notebook (no 'cells' list at the top level)")
    out = Cells()
    for number, cell in enumerate(cells, 1):
        if cell.get("cell_type") == "code":
            src = cell.get("source", "")
            _add(out, number, "".join(src) if isinstance(src, list) else src)
    return out


def _add(out: Cells, number: int, text: str) -> None:
    lines = text.splitlines()
    if lines and lines[0].startswith("%%"):
        words = lines[0][2:].split()
        name, target = (words[0] if words else ""), (words[-1] if len(words) > 1 else "")
        body = "\n".join(lines[1:])
        if name in SHELL_CELLS or (name == "script" and target in SHELL_CELLS) or \
                (name == "writefile" and target.endswith(SHELL_SUFFIXES)):
            out.shell.append((number, 2, body, False, 0))
            return
        if name == "writefile" and target.endswith(".py"):
            out.written.append((number, 2, body))  # a program of its own, run by torchrun later
            return
        if name not in PYTHON_CELLS:
            return  # %%html, %%javascript, ...: not code we check
        lines = [""] + lines[1:]
    source = "\n".join(lines)
    if not _parses(source):
        kept = []
        for k, line in enumerate(lines, 1):
            m = MAGIC.match(line)
            if not m:
                kept.append(line)
                continue
            indent, target, sigil, word, rest = m.groups()
            if sigil.startswith("!") or word in ("sx", "system"):
                command = (word + rest if sigil.startswith("!") else rest).strip()
                out.shell.append((number, k, command, True, line.find(command)))
            kept.append(f"{indent}{target} = None" if target else f"{indent}pass")
        source = "\n".join(kept)
        if not _parses(source):
            out.skipped.append(number)
            return
    for k, line in enumerate(source.splitlines() or [""], 1):
        out.python.append(line)
        out.where.append((number, k))


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
        return True
    except (SyntaxError, ValueError):
        return False
