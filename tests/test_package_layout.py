"""The package shows its parts: engine/, lessons/, experiments/ and one subpackage per tool.

The README's "Layout" section maps them; a module dropped at the top level, a tool without a
`ddp-lab` subcommand, or a notebook import of a name that is not where the map says fails here.
"""
import ast
import importlib
import importlib.util
import json
import re
from pathlib import Path

from ddp_lab import cli

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ddp_lab"
TOOLS = {"check", "doctor", "autopsy", "verify", "grade"}
PARTS = {"engine", "lessons", "experiments"} | TOOLS
ENGINE = {"launch", "runtime", "interactive", "elastic"}


def test_top_level_holds_only_the_parts_and_the_command():
    modules = {p.name for p in PKG.glob("*.py")}
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert modules == {"__init__.py", "cli.py"}, f"modules at the top of ddp_lab/: {sorted(modules)}"
    assert folders == PARTS, f"subpackages of ddp_lab/: {sorted(folders)}"


def test_the_engine_holds_launch_runtime_interactive_elastic():
    assert ENGINE <= {p.stem for p in (PKG / "engine").glob("*.py")}


def test_a_topic_of_several_modules_is_a_subpackage():
    """No two lesson modules share a topic prefix (profiling_model.py beside profiling.py)."""
    stems = sorted(p.stem for p in (PKG / "lessons").glob("*.py") if p.stem != "__init__")
    subpackages = {p.name for p in (PKG / "lessons").iterdir() if (p / "__init__.py").exists()}
    for a in stems:
        clash = [b for b in stems if b != a and b.startswith(a + "_")]
        clash += [b for b in subpackages if a.startswith(b + "_")]
        assert not clash, f"lessons/{a}.py and {clash}: make the topic a subpackage"
    assert {"profiling", "beyond"} <= subpackages


def test_every_tool_is_a_ddp_lab_subcommand():
    assert set(cli.SUBCOMMANDS) == TOOLS
    for name, (module, _) in cli.SUBCOMMANDS.items():
        assert module == f"ddp_lab.{name}" or module.startswith(f"ddp_lab.{name}."), (name, module)


def test_readme_layout_names_every_part():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):readme.index("## Glossary")]
    for part in PARTS:
        assert re.search(rf"^\s+{part}/", layout, re.M), f"README's Layout does not show ddp_lab/{part}/"
    for sub in (p for p in (PKG / "lessons").iterdir() if (p / "__init__.py").exists()):
        assert f"{sub.name}/" in layout, f"README's Layout does not show lessons/{sub.name}/"


def _imports(source: str):
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a cell with IPython magics
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddp_lab"):
            yield node.module, [a.name for a in node.names]


def test_every_notebook_import_from_ddp_lab_resolves():
    """Each `from ddp_lab... import name` in a notebook names a module or an attribute that exists."""
    seen = 0
    for path in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            for module, names in _imports("".join(cell["source"])):
                mod = importlib.import_module(module)
                for name in names:
                    seen += 1
                    ok = hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}") is not None
                    assert ok, f"{path.name}: from {module} import {name}: no such module or name"
    assert seen > 50
