"""A probe's source shown in a lesson is the source of what ran (issue 24, item 1).

Every `show(module.function)` in a lesson's code cells (`listing.show`, and notebook 07's own
`show`) must name a function of an experiment module that the same notebook launches
(`-m ddp_lab.experiments.<module>`), a function reachable from that program's entry point, and
the cell's stored output must hold the function's current source: a listing committed with the
notebook cannot drift from the module. The lessons in SHOWING show a function beside every probe
they launch, and store the listing with its caption (file and first line).
"""
import ast
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ddp_lab.engine import listing  # noqa: E402

LESSONS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
SHOWING = {"01_dataparallel_vs_ddp", "02_sampler_and_metrics", "03_ring_allreduce", "05_gradient_accumulation",
           "06_checkpointing", "08_profiling", "10_laptop_to_cluster", "11_ddp_on_gpus"}
LAUNCHED = re.compile(r"-m\s+ddp_lab\.experiments\.(\w+)")


def code(path) -> str:
    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
                     if c["cell_type"] == "code")


def launched(path) -> set[str]:
    """The experiment modules a notebook's code cells launch (torchrun, or an elastic agent's -m)."""
    return set(LAUNCHED.findall(code(path)))


def reachable(module) -> set[str]:
    return reachable_in(inspect.getsource(module))


def reachable_in(source: str) -> set[str]:
    """Module-level functions reachable from what runs: main() (the `-m` entry point) and any
    function the module's top level refers to (a table of cases), then whatever those refer to."""
    tree = ast.parse(source)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def names(node) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & set(defs)

    roots = {"main"} & set(defs)
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            roots |= names(node)
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(names(defs[name]) - seen)
    return seen


CASES = [(nb, s) for nb in LESSONS for s in listing.shown(nb)]


@pytest.mark.parametrize("notebook,shown", CASES,
                         ids=[f"{nb.stem}:{s.module}.{s.function}" for nb, s in CASES])
def test_each_shown_source_is_the_source_of_what_ran(notebook, shown):
    helper = _helper(shown.module)
    if helper is not None and shown.module not in launched(notebook):
        # a lesson helper or a grader's rule shown in the kernel (notebook 12): what ran is this source
        function = getattr(helper, shown.function, None)
        assert inspect.isfunction(function), f"{shown.module}.{shown.function} is not a function of the module"
        assert shown.output is not None and inspect.getsource(function) in shown.output, (
            f"{notebook.name} cell {shown.cell}: the stored listing of {shown.module}.{shown.function} "
            "differs from the module's source; re-run the notebook and store its outputs")
        return
    assert shown.module in launched(notebook), (
        f"{notebook.name} cell {shown.cell} shows {shown.module}.{shown.function}, "
        f"but launches only {sorted(launched(notebook))}")
    module = importlib.import_module(f"ddp_lab.experiments.{shown.module}")
    function = getattr(module, shown.function, None)
    assert inspect.isfunction(function), f"{shown.module}.{shown.function} is not a function of the module"
    assert shown.function in reachable(module), (
        f"{shown.module}.{shown.function} is shown in {notebook.name} but nothing the program runs calls it")
    if notebook.stem in SHOWING:
        assert shown.via == "listing.show", f"{notebook.name} cell {shown.cell}: use listing.show"
        assert shown.output is not None, f"{notebook.name} cell {shown.cell}: the listing's output is not stored"
    if shown.output is not None:
        assert inspect.getsource(function) in shown.output, (
            f"{notebook.name} cell {shown.cell}: the stored listing of {shown.module}.{shown.function} "
            "differs from the module's source; re-run the notebook and store its outputs")
        if shown.via == "listing.show":
            assert listing.caption(function) in shown.output, (
                f"{notebook.name} cell {shown.cell}: the stored caption is not {listing.caption(function)!r}")


def _helper(name: str):
    """The lesson or grader module a notebook imported by this name (not an experiment), or None."""
    for package in ("ddp_lab.lessons", "ddp_lab.grade.exercises"):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ImportError:
            continue
    return None


@pytest.mark.parametrize("name", sorted(SHOWING))
def test_every_probe_launched_has_its_code_on_screen(name):
    notebook = ROOT / "notebooks" / f"{name}.ipynb"
    modules = launched(notebook)
    assert modules, f"{name} launches no experiment module"
    assert modules <= {s.module for s in listing.shown(notebook)}, (
        f"{name}: launches {sorted(modules)} but shows code from {sorted({s.module for s in listing.shown(notebook)})}")


def test_show_renders_the_source_under_a_caption_with_file_and_line(monkeypatch):
    from ddp_lab.experiments import nb03_ring
    shown = []
    monkeypatch.setattr("IPython.display.display", shown.append)
    listing.show(nb03_ring.check, nb03_ring.sweep)
    text = shown[0].data
    lines = (ROOT / "ddp_lab" / "experiments" / "nb03_ring.py").read_text().splitlines()
    for name in ("check", "sweep"):
        first = next(n for n, line in enumerate(lines, 1) if line.startswith(f"def {name}("))
        caption = f"`ddp_lab/experiments/nb03_ring.py, line {first}`"
        body = inspect.getsource(getattr(nb03_ring, name))
        assert f"{caption}\n\n```python\n{body}```" in text
    assert text.index("def check(") < text.index("def sweep(")


def test_shown_finds_calls_and_stored_markdown(tmp_path):
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": ["listing.show(a.b) in prose is not a call"]},
        {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": ["%matplotlib inline\n",
                                                                               "listing.show(nb03_ring.check, nb03_ring.sweep)"],
         "outputs": [{"output_type": "display_data", "metadata": {},
                      "data": {"text/markdown": ["```python\n", "def check():\n", "```"], "text/plain": ["x"]}}]},
        {"cell_type": "code", "metadata": {}, "execution_count": None, "source": "show(nb07_collectives.skip_alone)",
         "outputs": []},
    ]
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    found = listing.shown(path)
    assert [(s.cell, s.module, s.function, s.via) for s in found] == [
        (1, "nb03_ring", "check", "listing.show"), (1, "nb03_ring", "sweep", "listing.show"),
        (2, "nb07_collectives", "skip_alone", "show")]
    assert found[0].output == "```python\ndef check():\n```" and found[2].output is None


def test_reachable_follows_calls_from_main_and_not_dead_code():
    from ddp_lab.experiments import nb03_ring
    assert {"main", "check", "bandwidth", "sweep", "parse_size"} <= reachable(nb03_ring)
    source = ("def main():\n    used()\n\ndef used():\n    helper\n\ndef helper():\n    pass\n\n"
              "def unused():\n    used()\n\ndef case():\n    pass\n\nCASES = {'case': case}\n")
    assert reachable_in(source) == {"main", "used", "helper", "case"}
