"""docs/coverage.md, the claims map, stays true to the repository.

The page has one row per claim of the two articles (ids E1.., S1..). Each row says what the
workbook does with the claim and where: a notebook section by its heading, a test node, a file.
Notebooks change under it (cells move, sections get renamed), so this test checks every row:
  (a) every id of both articles appears exactly once, numbered 1..N without gaps, N taken from
      the page's own summary table (whose per-status counts must match the rows);
  (b) every cited notebook exists;
  (c) every cited section heading exists in that notebook's markdown;
  (d) every cited test node exists (read with ast, nothing imported);
  (e) every other cited path exists;
  (f) every claim that is mentioned or not covered gives a reason from the fixed set.
Each failure names the row and what is missing.
"""
import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "coverage.md"

ARTICLES = {"E": "engineering article", "S": "survey article"}
STATUSES = ("asserted", "shown", "mentioned", "corrected", "not covered")
REASONS = ("GPU-only", "opinion", "out of scope")
NEEDS_REASON = ("mentioned", "not covered")
COLUMNS = ("id", "claim", "status", "where", "reason", "note")

ROW = re.compile(r"^\|\s*([ES])(\d+)\s*\|")
SECTION = re.compile(r'§\s*"([^"]+)"')
CODE = re.compile(r"`([^`]+)`")
# "3. ", "4.1 ", "00 · ", "06b · ": the numbering a heading may be cited without
NUMBERING = re.compile(r"^(?:\d+[a-z]?\s*·\s*|\d+[a-z]?(?:\.\d+)*\.?\s+)")


def cells(line: str) -> list[str]:
    """The cells of a markdown table row; `\\|` is a pipe inside a cell."""
    parts = re.split(r"(?<!\\)\|", line.strip())
    return [p.strip().replace("\\|", "|") for p in parts[1:-1]]


def parse_doc():
    text = DOC.read_text(encoding="utf-8")
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        m = ROW.match(line)
        if m:
            values = cells(line)
            rows.append({"line": n, "raw": line, "values": values,
                         "id": f"{m.group(1)}{m.group(2)}", "article": m.group(1),
                         "number": int(m.group(2)),
                         **dict(zip(COLUMNS, values))})
    return text, rows


def summary_table(text: str) -> dict[str, list[int]]:
    """status -> [engineering, survey, both] from the first table under '## Summary'."""
    after = text.split("\n## Summary", 1)
    assert len(after) == 2, f"{DOC.name}: no '## Summary' section"
    table, started = {}, False
    for line in after[1].splitlines():
        if line.startswith("|"):
            started = True
            values = cells(line)
            key = values[0].strip("* ").lower()
            if key in STATUSES or key == "total":
                table[key] = [int(v.strip("* ")) for v in values[1:4]]
        elif started:
            break
    return table


@pytest.fixture(scope="module")
def doc():
    assert DOC.exists(), f"{DOC.relative_to(ROOT)} is missing"
    return parse_doc()


def headings(notebook: Path) -> list[str]:
    """The text of every markdown heading in a notebook, '#'s stripped (fenced code skipped)."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    out = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        fenced = False
        for line in "".join(cell["source"]).splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and re.match(r"#{1,6}\s", line):
                out.append(line.lstrip("#").strip())
    return out


def citations(where: str) -> list[tuple[str, str, str | None]]:
    """('section', notebook, heading) | ('test', file, name) | ('path', path, None), in order.

    A section belongs to the notebook named before it in the same cell; a heading's own code
    spans (`shuffle`) are part of the heading, not paths."""
    spans = [(m.start(), m.end(), "section", m.group(1)) for m in SECTION.finditer(where)]
    inside = lambda pos: any(a <= pos < b for a, b, _, _ in spans)
    tokens = spans + [(m.start(), m.end(), "code", m.group(1))
                      for m in CODE.finditer(where) if not inside(m.start())]
    out, notebook = [], None
    for _, _, kind, value in sorted(tokens):
        if kind == "section":
            out.append(("section", notebook, value))
        elif "::" in value:
            path, name = value.split("::", 1)
            out.append(("test", path, name))
            notebook = None
        else:
            out.append(("path", value, None))
            notebook = value if value.endswith(".ipynb") else None
    return out


def test_every_row_is_well_formed(doc):
    _, rows = doc
    problems = []
    for r in rows:
        if len(r["values"]) != len(COLUMNS):
            problems.append(f"{r['id']} (line {r['line']}): {len(r['values'])} columns, "
                            f"expected {len(COLUMNS)} ({', '.join(COLUMNS)})")
        elif r["status"] not in STATUSES:
            problems.append(f"{r['id']}: status {r['status']!r} is not one of {STATUSES}")
        elif not r["claim"]:
            problems.append(f"{r['id']}: the claim is empty")
        elif not r["where"]:
            problems.append(f"{r['id']}: 'where' is empty (write — when nothing covers it)")
    assert not problems, "\n".join(problems)


def test_every_claim_appears_exactly_once_numbered_without_gaps(doc):  # (a)
    text, rows = doc
    summary = summary_table(text)
    assert "total" in summary, "the summary table has no total row"
    problems = []
    for column, (prefix, article) in enumerate(ARTICLES.items()):
        expected = summary["total"][column]
        numbers = [r["number"] for r in rows if r["article"] == prefix]
        twice = sorted({n for n in numbers if numbers.count(n) > 1})
        missing = sorted(set(range(1, expected + 1)) - set(numbers))
        extra = sorted(set(numbers) - set(range(1, expected + 1)))
        if twice:
            problems.append(f"{article}: rows {', '.join(f'{prefix}{n}' for n in twice)} appear more than once")
        if missing:
            problems.append(f"{article}: the summary counts {expected} claims but rows "
                            f"{', '.join(f'{prefix}{n}' for n in missing)} are missing")
        if extra:
            problems.append(f"{article}: rows {', '.join(f'{prefix}{n}' for n in extra)} lie beyond "
                            f"the {expected} claims the summary counts")
        for status in STATUSES:
            counted = summary.get(status, [None] * 3)[column]
            actual = sum(1 for r in rows if r["article"] == prefix and r.get("status") == status)
            if counted != actual:
                problems.append(f"{article}: the summary says {counted} {status}, the rows have {actual}")
    assert not problems, "\n".join(problems)


def test_every_cited_notebook_and_section_exists(doc):  # (b), (c)
    _, rows = doc
    problems, cache = [], {}
    for r in rows:
        for kind, path, heading in citations(r.get("where", "")):
            if kind == "path" and path.endswith(".ipynb") and not (ROOT / path).is_file():
                problems.append(f"{r['id']}: cites notebook {path}, which does not exist")
            if kind != "section":
                continue
            if path is None:
                problems.append(f'{r["id"]}: section § "{heading}" follows no notebook')
                continue
            if not (ROOT / path).is_file():
                continue  # reported above
            if path not in cache:
                cache[path] = headings(ROOT / path)
            found = cache[path]
            if heading not in found and heading not in [NUMBERING.sub("", h, count=1) for h in found]:
                problems.append(f'{r["id"]}: {path} has no heading "{heading}" '
                                f"(its headings: {'; '.join(found)})")
    assert not problems, "\n".join(problems)


def test_every_cited_test_node_exists(doc):  # (d)
    _, rows = doc
    problems, cache = [], {}
    for r in rows:
        for kind, path, name in citations(r.get("where", "")):
            if kind != "test":
                continue
            file = ROOT / path
            if not file.is_file():
                problems.append(f"{r['id']}: cites {path}::{name}, but {path} does not exist")
                continue
            if path not in cache:
                tree = ast.parse(file.read_text(encoding="utf-8"))
                cache[path] = {f"{c.name}::{f.name}" if c else f.name
                               for c, f in _functions(tree)}
            if name.split("[", 1)[0] not in cache[path]:
                problems.append(f"{r['id']}: {path} has no test {name}")
    assert not problems, "\n".join(problems)


def _functions(tree):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield None, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield node, item


def test_every_cited_path_exists(doc):  # (e)
    _, rows = doc
    problems = []
    for r in rows:
        for kind, path, _ in citations(r.get("where", "")):
            if kind == "path" and not path.endswith(".ipynb") and not (ROOT / path).exists():
                problems.append(f"{r['id']}: cites {path}, which does not exist")
    assert not problems, "\n".join(problems)


def test_uncovered_claims_say_why(doc):  # (f)
    _, rows = doc
    problems = []
    for r in rows:
        status, reason = r.get("status"), r.get("reason", "")
        if status in NEEDS_REASON and reason not in REASONS:
            problems.append(f"{r['id']} is {status} but gives "
                            f"{'no reason' if not reason else f'the reason {reason!r}'}; "
                            f"expected one of {REASONS}")
        elif status not in NEEDS_REASON and reason and reason not in REASONS:
            problems.append(f"{r['id']}: reason {reason!r} is not one of {REASONS}")
    assert not problems, "\n".join(problems)


def test_parser_reads_the_citation_forms():
    """The citation parser itself: a heading's code spans stay in the heading."""
    where = ('`notebooks/a.ipynb` § "2. `shuffle` and `set_epoch`" · § "Summary"; '
             '`tests/test_x.py::test_y`; `docs/z.md`')
    assert citations(where) == [("path", "notebooks/a.ipynb", None),
                                ("section", "notebooks/a.ipynb", "2. `shuffle` and `set_epoch`"),
                                ("section", "notebooks/a.ipynb", "Summary"),
                                ("test", "tests/test_x.py", "test_y"),
                                ("path", "docs/z.md", None)]
    assert NUMBERING.sub("", "4.1 The gradient reduce", count=1) == "The gradient reduce"
    assert NUMBERING.sub("", "06b · The script ladder", count=1) == "The script ladder"
