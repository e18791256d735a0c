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
