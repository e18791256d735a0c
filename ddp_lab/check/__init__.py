"""A static checker for the classic DDP bugs in your own training code.

    ddp-lab check train.py launch.sh notebooks/      # or: python -m ddp_lab.check ...

It reads Python files, shell/.sbatch scripts and notebooks (code cells and `!` lines) with
Python's `ast` and a small shell reader; it never imports or runs them. Every finding has a
stable id, a line, one sentence, the fix, and the notebook section that shows the bug:

    train.py:41:9: DDP010 Gradient accumulation without no_sync: ...
      fix: run forward and backward inside `with model.no_sync():` ...
      see: notebooks/05_gradient_accumulation.ipynb, section "4. The articles' ..."

Exit code 0: nothing found; 1: findings; 2: a path could not be read, parsed or analysed (one error
line each; the other files' findings are still printed), or no file was checked.
Silence one finding with a comment on its line: `# ddp-lab: ignore[DDP010]`.

From a notebook cell:

    from ddp_lab import check
    findings = check.source(code)                    # kind="python" | "shell" | "cell" | "notebook"
    assert [f.id for f in findings] == ["DDP010"]

The rules are listed, each with an example, in docs/check.md (and by `ddp-lab check --list-rules`).
"""
from __future__ import annotations

import json

# importing the rule modules registers their rules
from . import rules_accum, rules_amp, rules_ckpt, rules_more, rules_seed, rules_setup, rules_train, shell  # noqa: F401
from . import rules_local  # noqa: F401  (DDP021-DDP023)
from . import rules_field  # noqa: F401  (DDP024-DDP028)
from .core import RULES, SECTIONS, Finding, Rule
from .files import (PYTHON_SUFFIXES, TOO_DEEP, Unreadable, check_file, ipynb, iter_files, python, read_python,
                    shell_script)
from .imports import Project

__all__ = ["RULES", "SECTIONS", "Finding", "Rule", "Unreadable", "source", "check_file", "check_paths"]


def source(code: str, kind: str = "python", select=None, ignore=()) -> list[Finding]:
    """Findings in a piece of code. kind: "python"; "shell" (a script or one command line);
    "cell" (one notebook cell: magics and `!` lines allowed); "notebook" (an .ipynb file's JSON
    text). Paths in the findings read "<source>"; in a cell, lines are the cell's lines."""
    if kind == "cell":
        code, kind = json.dumps({"cells": [{"cell_type": "code", "source": code}]}), "notebook"
    run = {"python": python, "shell": shell_script, "notebook": ipynb}.get(kind)
    if run is None:
        raise ValueError(f"kind must be 'python', 'shell', 'cell' or 'notebook', not {kind!r}")
    return run(code, "<source>", select, ignore)


def check_paths(paths, select=None, ignore=()) -> tuple[list[Finding], list[tuple[str, str]], int]:
    """(findings, [(path, why it could not be checked)], number of files checked). Several Python
    files checked together are one project: calls into each other's functions are followed. A file
    that cannot be read, parsed or analysed is one error; the other files are still checked."""
    findings, errors, checked = [], [], 0
    files = list(iter_files(paths))
    py = [p for p in files if p.suffix.lower() in PYTHON_SUFFIXES and p.is_file()]
    project = Project(py, paths, read_python) if len(py) > 1 else None
    for path in files:
        try:
            if not path.exists():
                raise Unreadable("no such file or folder")
            findings += check_file(path, select, ignore, project)
            checked += 1
        except Unreadable as e:
            errors.append((str(path), str(e)))
        except RecursionError:
            errors.append((str(path), TOO_DEEP.format(what="the checker")))
        except Exception as e:  # noqa: BLE001  (one file the checker fails on must not lose the others' findings)
            errors.append((str(path), f"could not be analysed ({type(e).__name__}: {e}); please report it"))
    return findings, errors, checked
