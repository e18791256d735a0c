"""docs/workshop.md, the instructor's guide, covers every lesson notebook: a new notebook cannot be forgotten.

Every lesson in notebooks/ (not its solutions) needs (a) a row in the timing table between the
markers that `make workbook --workshop` rewrites, and (b) a `### NN · Title` section in "Notebook by
notebook" with its run-live/narrate plan and one takeaway. Every row and section must name a
notebook that exists (a renamed notebook leaves no stale slot), except the few planned ones listed
below while they are being written. The timing cells hold a measured time or a dash, never prose.
"""
import re
from pathlib import Path

from ddp_lab.engine import workbook

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "workshop.md"
LESSONS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
# lessons the guide already plans for while their notebook is being written (e.g. {"11"}); empty otherwise,
# so that a slot whose notebook was renamed or removed fails the test
PLANNED: set = set()


def _text():
    return DOC.read_text(encoding="utf-8")


def _table_rows():
    table = _text().split(workbook.START, 1)[1].split(workbook.END, 1)[0]
    lines = [line for line in table.strip().splitlines() if line.startswith("|")]
    assert lines[:2] == workbook.TABLE_HEADER, "the timing table's header is what make workbook writes"
    return {workbook._cells(line)[0]: workbook._cells(line) for line in lines[2:]}


def _sections():
    part = _text().split("## Notebook by notebook", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): body for m, body in zip(
        re.finditer(r"^### (\d+[a-z]?) · .+$", part, re.M),
        re.split(r"^### \d+[a-z]? · .+$", part, flags=re.M)[1:])}


def test_there_are_lessons_to_cover():
    assert len(LESSONS) >= 13 and {workbook.lesson_id(p.name) for p in LESSONS} >= {"00", "01b", "06b", "10"}


def test_every_lesson_has_a_timing_row_and_a_section_with_a_plan_and_a_takeaway():
    rows, sections = _table_rows(), _sections()
    for path in LESSONS:
        key = workbook.lesson_id(path.name)
        assert key in rows, f"{path.name}: no row `| {key} |` in the timing table of {DOC.name}"
        assert key in sections, f"{path.name}: no section `### {key} · ...` under 'Notebook by notebook'"
        body = sections[key]
        assert "**Live:**" in body, f"{key}: the section says nothing about what runs live"
        assert body.count("**Takeaway:**") == 1, f"{key}: one takeaway, no more"


def test_every_row_and_section_names_an_existing_or_planned_lesson():
    existing = {workbook.lesson_id(p.name) for p in LESSONS}
    for key in set(_table_rows()) | set(_sections()):
        assert key in existing or key in PLANNED, f"{DOC.name} has a slot for {key}, but no notebook {key}_*.ipynb"


def test_timing_cells_hold_a_measured_time_or_a_dash():
    """What `make workbook --workshop` writes, or what is left before it ran; never a typed estimate."""
    for key, cells in _table_rows().items():
        assert len(cells) == 5, key
        _, _, seconds, core, where = cells
        assert seconds == core == where == "—" or (
            re.fullmatch(r"\d+ s", seconds) and re.match(r"\d{4}-\d\d-\d\d, \d+ cores, ", where)), cells
        assert core == "—" or (re.fullmatch(r"\d+ s", core) and int(core[:-2]) <= int(seconds[:-2])), cells


def test_the_core_agenda_includes_01b_and_make_workbook_updates_this_guide():
    half_day = _text().split("**Half day", 1)[1].split("**Full day", 1)[0]
    assert "01b" in half_day
    full_day = _text().split("**Full day", 1)[1].split("\n## ", 1)[0]
    for key in {workbook.lesson_id(p.name) for p in LESSONS} | PLANNED:
        assert re.search(rf"\| {key}[ ,]", full_day) or f" {key} " in full_day, f"the full day leaves out {key}"
    makefile = (ROOT / "Makefile").read_text()
    assert "--workshop docs/workshop.md" in makefile.split("\nworkbook:", 1)[1].split("\n\n", 1)[0]
