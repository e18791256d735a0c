"""A probe's own source, shown beside its result.

    from ddp_lab.engine import listing
    from ddp_lab.experiments import nb03_ring
    listing.show(nb03_ring.check)      # beside the launch of -m ddp_lab.experiments.nb03_ring

`show` renders each function's source exactly as `inspect.getsource` reads it from the
module that ran, under a caption naming the file and the first line ("ddp_lab/experiments/
nb03_ring.py, line 24"): the learner reads the code behind the output, never a paraphrase.
`shown` finds every `show(module.function)` call in a notebook's code cells, with the cell's
stored Markdown output, so tests/test_shown_source.py can check that each listing is the
source of what the notebook launched and has not drifted from the module.
"""
from __future__ import annotations

import ast
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

from ddp_lab.engine.launch import ROOT


def caption(function) -> str:
    """'ddp_lab/experiments/nb03_ring.py, line 24': where `function` starts."""
    path = Path(inspect.getsourcefile(function)).resolve()
    try:
        path = path.relative_to(ROOT)
    except ValueError:  # a function from outside the repository: keep its full path
        pass
    return f"{path.as_posix()}, line {inspect.getsourcelines(function)[1]}"


def markdown(*functions) -> str:
    """The Markdown `show` displays: a caption line, then the source in a fenced block, per function."""
    parts = []
    for f in functions:
        source = inspect.getsource(f)
        parts.append(f"`{caption(f)}`\n\n```python\n{source if source.endswith(chr(10)) else source + chr(10)}```")
    return "\n\n".join(parts)


def show(*functions) -> None:
    """Display each function's source, as it is in the module that ran, with its file and line."""
    from IPython.display import Markdown, display
    display(Markdown(markdown(*functions)))


@dataclass
class Shown:
    """One `show(module.function)` found in a notebook: where, what, and the cell's stored Markdown."""
    cell: int
    module: str        # the name used in the call (e.g. nb03_ring)
    function: str      # the attribute shown (e.g. check)
    via: str           # how show was called: "listing.show" or a notebook's own "show"
    output: str | None  # the cell's stored text/markdown output, None when the cell has no outputs


def _calls(source: str):
    # every show(X.Y, ...) / listing.show(X.Y, ...) call, as (X, Y, how show was named); IPython
    # magics are blanked first
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name != "show":
            continue
        via = ast.unparse(f)
        for arg in node.args:
            if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name):
                yield arg.value.id, arg.attr, via


def shown(notebook_path) -> list[Shown]:
    """Every `show(module.function)` call in the code cells of a notebook, in order."""
    nb = json.loads(Path(notebook_path).read_text(encoding="utf-8"))
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        outputs = cell.get("outputs") or []
        text = None
        if outputs:
            text = "".join("".join(o["data"]["text/markdown"]) if isinstance(o["data"]["text/markdown"], list)
                           else o["data"]["text/markdown"]
                           for o in outputs if "text/markdown" in o.get("data", {}))
        for module, function, via in _calls(source):
            found.append(Shown(i, module, function, via, text))
    return found
