"""A lesson's core path and its deep dives, read from the notebook itself.

A lesson is read in three parts, decided by its headings:

- **core**: what a learner in a hurry reads and runs, and what a workshop slot teaches;
- **deep**: a section headed `## Deep dive: ...`. Optional: no core cell after it needs it. It runs
  under nbval like every other cell. A deep dive ends at the next `#`/`##` heading, or at the
  closing block's `### On a GPU cluster`;
- **exercises**: from `## Exercises` on, practice rather than reading.

The closing block (the GPU box, `## Summary`, `### What you can now do`) is core. Executed
notebooks keep each code cell's start and end (nbclient's `metadata.execution`), so the time of
each part can be read from a stored lesson without running it again.

The Chinese edition (notebooks/zh/) heads the same parts with the forms docs/glossary.zh.md fixes:
`## 深入：...`, `### 在 GPU 集群上`, `## 练习`; each is read as its English form.
"""
from __future__ import annotations

import re
from datetime import datetime

HEADING = re.compile(r"^(#{1,3}) (.+?)\s*$", re.M)
DEEP, GPU_BOX, EXERCISES = "Deep dive:", "On a GPU cluster", "Exercises"
ZH_DEEP, ZH_GPU_BOX, ZH_EXERCISES = "深入：", "在 GPU 集群上", "练习"  # docs/glossary.zh.md
DEEPS, GPU_BOXES, EXERCISE_HEADS = (DEEP, ZH_DEEP), (GPU_BOX, ZH_GPU_BOX), (EXERCISES, ZH_EXERCISES)
WORD = re.compile(r"\S+")


def _text(cell) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def _after(heading: tuple[str, str], part: str) -> str:
    """The part that a heading (its #'s, its title) opens; `part` where it opens none."""
    level, title = len(heading[0]), heading[1]
    if level <= 2 and title.startswith(DEEPS):
        return "deep"
    if level <= 2 and title.startswith(EXERCISE_HEADS):
        return "exercises"
    if level <= 2 or (level == 3 and title.startswith(GPU_BOXES)):
        return "core"
    return part


def parts(cells) -> list[str]:
    """"core", "deep" or "exercises" for each cell. A markdown cell that opens with a heading belongs
    to the part that heading opens; a heading further down a cell changes the part of what follows."""
    out, part = [], "core"
    for cell in cells:
        headings = HEADING.findall(_text(cell)) if cell["cell_type"] == "markdown" else []
        if headings and _text(cell).lstrip().startswith("#"):
            part = _after(headings[0], part)
        out.append(part)
        for h in headings[1:]:
            part = _after(h, part)
    return out


def deep_dives(cells) -> list[str]:
    """The titles of a lesson's deep dives, in order (without "Deep dive: " or "深入：")."""
    return [t.split(DEEP if t.startswith(DEEP) else ZH_DEEP, 1)[1].strip() for c in cells
            if c["cell_type"] == "markdown"
            for level, t in HEADING.findall(_text(c)) if len(level) <= 2 and t.startswith(DEEPS)]


def words(cells, part: str = "core") -> int:
    """Words of markdown in one part of a lesson."""
    return sum(len(WORD.findall(_text(c))) for c, p in zip(cells, parts(cells))
               if p == part and c["cell_type"] == "markdown")


def _seconds(cell) -> float | None:
    stamps = cell.get("metadata", {}).get("execution", {})
    start, end = stamps.get("iopub.execute_input"), stamps.get("shell.execute_reply")
    if not (start and end):
        return None
    parse = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    return (parse(end) - parse(start)).total_seconds()


def seconds(cells, part: str = "core") -> float | None:
    """Seconds the code cells of one part took in the notebook's last execution, or None where any
    of them carries no timing (never executed, or stored without it)."""
    times = [_seconds(c) for c, p in zip(cells, parts(cells)) if p == part and c["cell_type"] == "code"]
    return None if any(t is None for t in times) else sum(times)


WORDS_PER_MINUTE = 200  # reading technical prose with code beside it


def reading_minutes(n_words: int) -> int:
    """Minutes to read n_words of a lesson, rounded up."""
    return -(-n_words // WORDS_PER_MINUTE)


def map_row(name: str, cells) -> str:
    """A lesson's row in the README's core-path table: its reading time and its deep dives."""
    dives = "; ".join(deep_dives(cells)) or "none"
    return f"| {name} | ~{reading_minutes(words(cells))} min | {dives} |"
