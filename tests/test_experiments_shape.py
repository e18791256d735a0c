"""Every program in ddp_lab/experiments/ has one shape: a main() that parses its own arguments,
called under `if __name__ == "__main__":`, and no work at import time (a notebook or a test can
import it, and its helpers belong in the lesson's module anyway)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "ddp_lab" / "experiments"
PROGRAMS = sorted(p for p in EXPERIMENTS.glob("nb*.py"))


def test_every_program_is_named_after_its_notebook():
    names = {p.name for p in EXPERIMENTS.glob("*.py")} - {"__init__.py"}
    assert names == {p.name for p in PROGRAMS}, "name programs nbNN_topic.py after their notebook"


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: p.stem)
def test_main_and_a_guard_and_nothing_at_import_time(path):
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), "the docstring is the run recipe"
    assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), "no main()"
    guard = tree.body[-1]
    assert isinstance(guard, ast.If) and "__name__" in ast.unparse(guard.test), "no __main__ guard at the end"
    for node in tree.body[:-1]:
        if isinstance(node, ast.Try):  # an import with a fallback for older torch
            inner = node.body + [s for h in node.handlers for s in h.body]
            assert all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in inner), f"line {node.lineno}"
            continue
        # imports, definitions and constants only: no calls, loops or `with` blocks at import time
        assert isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign,
                                 ast.AnnAssign, ast.Expr)), f"line {node.lineno}: work at import time"
        if isinstance(node, ast.Expr):
            assert isinstance(node.value, ast.Constant), f"line {node.lineno}: a call at import time"
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            calls = [ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)]
            assert not any("argparse" in c or "parse_args" in c for c in calls), \
                f"line {node.lineno}: arguments are parsed in main(), not at import time"


def test_importing_every_program_runs_nothing():
    modules = [f"ddp_lab.experiments.{p.stem}" for p in PROGRAMS]
    code = ("import importlib, sys; sys.argv = ['x', '--no-such-flag']\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "import torch.distributed as dist; print('initialized', dist.is_initialized())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=EXPERIMENTS.parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines() == ["initialized False"], proc.stdout[-2000:]
