"""docs/gpu_room.md, the instructors' page for a room with GPUs: a card for every lesson, and every
line of a card marked measured (pointing at a record of docs/gpu_results.md that exists),
documented (with its source) or expected."""
import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ROOM = DOCS / "gpu_room.md"
LESSONS = sorted(p.name.split("_", 1)[0] for p in (ROOT / "notebooks").glob("[0-9]*.ipynb"))
MARK = re.compile(r"^- \*\*(measured|documented|expected)\*\*")


def slug(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def cards() -> dict:
    part = ROOM.read_text(encoding="utf-8").split("## Cards", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^### (\d+[a-z]?) · .+\n((?:.*\n)*?)(?=^### |\Z)", part + "\n", re.M)
    return {lesson: [line for line in body.splitlines() if line.strip()] for lesson, body in found}


def result_anchors() -> set:
    text = (DOCS / "gpu_results.md").read_text(encoding="utf-8")
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_the_slug_is_githubs():
    assert slug("2026-12-04 14:38 UTC: 1 × NVIDIA H200") == "2026-12-04-1438-utc-1--nvidia-h200"
    assert slug("What the first GPU runs found (2026-12-04, one H200, torch 2.11)") == \
        "what-the-first-gpu-runs-found-2026-12-04-one-h200-torch-211"


def test_every_lesson_has_a_card():
    assert sorted(cards()) == LESSONS


def test_every_line_of_a_card_carries_one_mark_and_its_evidence():
    anchors = result_anchors()
    problems = []
    for lesson, lines in cards().items():
        assert lines, f"the card of {lesson} is empty"
        for line in lines:
            mark = MARK.match(line)
            if not mark:
                problems.append(f"{lesson}: no mark: {line[:80]}")
            elif mark.group(1) == "measured":
                links = re.findall(r"\]\(gpu_results\.md#([^)]+)\)", line)
                if not links or any(a not in anchors for a in links):
                    problems.append(f"{lesson}: measured, but not at a heading of gpu_results.md: {line[:80]}")
            elif mark.group(1) == "documented" and not re.search(r"\]\(https://[^)]+\)", line):
                problems.append(f"{lesson}: documented without its source: {line[:80]}")
    assert not problems, "\n".join(problems)


def test_the_60_minute_path_cites_only_records_that_exist():
    path = ROOM.read_text(encoding="utf-8").split("## A 60-minute path", 1)[1]
    steps = re.findall(r"^\d+\. \*\*Minutes (\d+)-(\d+)", path, re.M)
    assert steps and steps[0][0] == "0" and steps[-1][1] == "60"
    assert all(a[1] == b[0] for a, b in zip(steps, steps[1:])), "the steps leave a gap or overlap"
    assert path.count("Look for:") == len(steps)
    assert set(re.findall(r"\]\(gpu_results\.md#([^)]+)\)", path)) <= result_anchors()


def test_the_room_is_linked_from_the_workshop_guide_and_notebook_11():
    assert "](gpu_room.md)" in (DOCS / "workshop.md").read_text(encoding="utf-8")
    first = nbformat.read(ROOT / "notebooks" / "11_ddp_on_gpus.ipynb", as_version=4).cells[0].source
    assert "](../docs/gpu_room.md)" in first and "make gpu-check" in first


def test_notebook_11_opens_true_on_cpu_and_gpu_machines():
    first = nbformat.read(ROOT / "notebooks" / "11_ddp_on_gpus.ipynb", as_version=4).cells[0].source
    assert "Everything before this notebook ran on CPU" not in first  # false on a GPU machine
