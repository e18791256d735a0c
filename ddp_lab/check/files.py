"""Running the rules over Python source, shell scripts, notebooks, files and folders."""
from __future__ import annotations

import ast
import io
import os
import tokenize
from pathlib import Path

from . import notebook, shell
from .core import SECTIONS, Finding, Hit, Rule, ignore_comments, rules_of, suppressed
from .pyfacts import Module

PYTHON_SUFFIXES = (".py", ".pyw")
SHELL_SUFFIXES = (".sh", ".bash", ".sbatch", ".slurm")
SKIP_DIRS = {".git", ".venv", "venv", "env", "__pycache__", "node_modules", "build", "dist", "site-packages",
             ".ipynb_checkpoints", ".tox", ".nox", ".mypy_cache", ".pytest_cache"}


class Unreadable(Exception):
    """A file that cannot be read, parsed or analysed (exit code 2)."""


TOO_DEEP = ("nested too deeply to analyse ({what} ran out of recursion depth): split the expression into "
            "several statements, or leave this file out of the paths checked")


def _finding(rule: Rule, hit: Hit, path: str, module: Module | None = None) -> Finding:
    if isinstance(hit.where, int):
        line, col, span = hit.where, hit.col, (hit.where, hit.where)
    else:
        node = hit.where
        line, col = node.lineno, node.col_offset + 1
        stmt = module.statement(node) if module is not None else node
        compound = isinstance(stmt, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try,
                                     ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        span = (min(stmt.lineno, line), node.end_lineno if compound else max(stmt.end_lineno, node.end_lineno))
    return Finding(rule.id, path, line, col, hit.message or rule.sentence, rule.fix, rule.see, span=span,
                   section=SECTIONS.get(rule.section))


def parse(text: str) -> ast.Module:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError) as e:
        raise Unreadable(f"cannot parse as Python: {getattr(e, 'msg', e)} (line {getattr(e, 'lineno', '?')})") from None
    except (RecursionError, MemoryError):
        raise Unreadable(TOO_DEEP.format(what="Python's parser")) from None


def python(text: str, path: str = "<source>", select=None, ignore=(), multiprocess: bool = True,
           module: Module | None = None) -> list[Finding]:
    """Findings in Python source; raises Unreadable when it does not parse. multiprocess=False:
    the code runs in one process (a notebook's kernel), so "on every rank" rules stay quiet.
    module: the text already parsed (a file checked with others, imports.Project)."""
    if module is None:
        module = Module(parse(text), text)
    module.multiprocess = multiprocess
    found = [_finding(r, hit, path, module) for r in rules_of("python", select, ignore) for hit in _hits(r, module)]
    return _finish(found, ignore_comments(text, python=True))


def _hits(rule: Rule, facts) -> list[Hit]:
    try:
        return list(rule.func(facts))
    except RecursionError:
        raise Unreadable(TOO_DEEP.format(what=rule.id)) from None
    except Exception as e:  # a bug in a rule must not hide the other rules' findings silently
        raise Unreadable(f"{rule.id} failed on this file ({type(e).__name__}: {e}); please report it") from e


def shell_script(text: str, path: str = "<source>", select=None, ignore=(), bang: bool = False) -> list[Finding]:
    """Findings in a shell script (or, with bang=True, one notebook `!` command)."""
    script = shell.scan(text, bang=bang)
    found = [_finding(r, hit, path) for r in rules_of("shell", select, ignore) for hit in _hits(r, script)]
    return _finish(found, ignore_comments(text, python=False))


def ipynb(text: str, path: str = "<notebook>", select=None, ignore=()) -> list[Finding]:
    try:
        cells = notebook.read(text)
    except ValueError as e:
        raise Unreadable(str(e)) from None
    found = []
    for f in python("\n".join(cells.python), path, select, ignore, multiprocess=False) if cells.python else []:
        f.cell, f.line = cells.where[f.line - 1]
        found.append(f)
    for cell, first, program in cells.written:
        try:
            written = python(program, path, select, ignore)
        except Unreadable:
            written = []  # a cell that writes something else than Python we can parse
        for f in written:
            f.cell, f.line = cell, f.line + first - 1
            found.append(f)
    for cell, first, script, bang, offset in cells.shell:
        for f in shell_script(script, path, select, ignore, bang=bang):
            f.cell, f.line, f.col = cell, f.line + first - 1, f.col + offset
            found.append(f)
    return sorted(found, key=lambda f: (f.cell, f.line, f.col, f.id))


def _finish(found: list[Finding], ignores: dict) -> list[Finding]:
    unique = {(f.id, f.line, f.col, f.message): f for f in found if not suppressed(f, ignores)}
    return sorted(unique.values(), key=lambda f: (f.line, f.col, f.id))


def kind_of(path: Path) -> str | None:
    """"python", "shell" or "notebook", from the suffix or a `#!` line; None if neither."""
    name = path.name.lower()
    if name.endswith(PYTHON_SUFFIXES):
        return "python"
    if name.endswith(SHELL_SUFFIXES):
        return "shell"
    if name.endswith(".ipynb"):
        return "notebook"
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return None
    if first.startswith(b"#!"):
        return "python" if b"python" in first else "shell" if any(s in first for s in (b"sh", b"bash", b"zsh")) else None
    return None


def read(path, kind: str) -> str:
    try:
        data = Path(path).read_bytes()
        # Python files may declare their encoding (PEP 263); everything else is UTF-8
        encoding = tokenize.detect_encoding(io.BytesIO(data).readline)[0] if kind == "python" else "utf-8"
        return data.decode(encoding)
    except (OSError, UnicodeDecodeError, SyntaxError, LookupError) as e:
        raise Unreadable(f"cannot read: {e}") from None


def read_python(path) -> tuple[str, ast.Module]:
    text = read(path, "python")
    return text, parse(text)


def check_file(path, select=None, ignore=(), project=None) -> list[Finding]:
    """Findings in one file; raises Unreadable when it cannot be read, parsed or classified.
    project: the files checked together (imports.Project), whose imports are followed."""
    path = Path(path)
    kind = kind_of(path)
    if kind is None:
        raise Unreadable("not a Python file, shell script or notebook (.py, .sh, .sbatch, .ipynb, or a #! line)")
    if kind == "python" and project is not None and path.suffix.lower() in PYTHON_SUFFIXES:
        module = project.module(path)
        return python(module.text, str(path), select, ignore, module=module)
    text = read(path, kind)
    run = {"python": python, "shell": shell_script, "notebook": ipynb}[kind]
    return run(text, str(path), select, ignore)


def iter_files(paths):
    """The files to check: each file named, and every checkable file under each folder named
    (hidden folders, virtual environments and build output left out), in a stable order."""
    for p in map(Path, paths):
        if not p.is_dir():
            yield p
            continue
        for root, dirs, files in os.walk(p):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
            for name in sorted(files):
                f = Path(root) / name
                if f.suffix.lower() in (*PYTHON_SUFFIXES, *SHELL_SUFFIXES, ".ipynb"):
                    yield f
