"""What a learner sees before running anything: every lesson is in the README's map, links to its
solutions, and the solutions link back; the stored kernel is the one JupyterLab installs."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))


def markdown(path) -> str:
    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                     if c["cell_type"] == "markdown")


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_and_solutions_link_to_each_other(lesson):
    solutions = lesson.parent / "solutions" / f"{lesson.stem}_solutions.ipynb"
    assert solutions.exists(), f"{lesson.name} has no solutions notebook"
    assert re.search(rf"\]\(solutions/{re.escape(solutions.name)}\)", markdown(lesson)), \
        f"{lesson.name}: no clickable link to its solutions"
    assert re.search(rf"\]\(\.\./{re.escape(lesson.name)}\)", markdown(solutions)), \
        f"{solutions.name}: no clickable link back to the lesson"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_is_in_the_readme_map(lesson):
    assert f"](notebooks/{lesson.name})" in (ROOT / "README.md").read_text()


GPU_BOX = "### On a GPU cluster"


@pytest.mark.parametrize("lesson", [p for p in LESSONS if not p.name.startswith("00")], ids=lambda p: p.stem)
def test_every_lesson_says_what_changes_on_gpus_and_how_it_knows(lesson):
    """Each lesson 01-10 has its GPU box; every statement in it is marked measured here,
    documented (with a link to its source) or expected."""
    cells = ["".join(c["source"]) for c in json.loads(lesson.read_text())["cells"] if c["cell_type"] == "markdown"]
    starts = [i for i, c in enumerate(cells) if GPU_BOX in c]
    assert len(starts) == 1, f"{lesson.name}: expected one '{GPU_BOX}' section, found {len(starts)}"
    box = cells[starts[0]].split(GPU_BOX, 1)[1].split("\n#", 1)[0]
    for more in cells[starts[0] + 1:]:  # a box too long for one cell goes on in bullet cells, up to a heading
        if not more.lstrip().startswith("- "):
            break
        box += "\n" + more
    items = re.findall(r"^\s*[-*] (.+(?:\n(?!\s*[-*] ).+)*)", box, flags=re.M)
    assert len(items) >= 3, f"{lesson.name}: the GPU box has {len(items)} statements"
    for item in items:
        marks = [m.lower() for m in re.findall(r"measured here|documented|expected", item, flags=re.I)]
        assert marks, f"{lesson.name}: a GPU statement says neither measured here, documented nor expected:\n{item}"
        if marks == ["documented"]:
            assert re.search(r"https?://|\]\(\.\./", item), f"{lesson.name}: 'documented' without its source:\n{item}"
