"""The Chinese edition: gettext catalogs of the lessons' markdown, and the notebooks built from them.

    python -m ddp_lab.engine.zh update   # catalogs follow the English: new cells added, changed ones fuzzy
    python -m ddp_lab.engine.zh status   # what needs translating, per notebook, with cell index and first line
    python -m ddp_lab.engine.zh build    # notebooks/zh/ from the English notebooks and their catalogs (make zh)
    python -m ddp_lab.engine.zh build --draft   # the same, English left where a cell is not translated yet
    python -m ddp_lab.engine.zh terms FILE.json ...   # {term: {"definition": re, "use": re}} into docs/terms.json

One catalog per notebook, `notebooks/zh/locale/<notebook stem>.po` (solutions included): each entry's
msgid is one English markdown cell, exactly; its msgstr the Chinese. A translator opens a catalog in
Poedit or Weblate. When an English cell changes, `update` keeps the old translation as a *fuzzy*
entry (with the old English as its previous msgid), which the build refuses: a stale translation is
never shown as current.

A Chinese notebook is its English one with each markdown cell replaced by its translation: code
cells, their outputs, metadata and ids are the English ones, so the figures agree across editions.
It lives one folder deeper (`notebooks/zh/`), so a relative link that leaves the lessons
(`../docs/x.md`, `first_ddp.py`) is rewritten to reach the same file from there; a link to a lesson or
a solution stays as it is and lands on the Chinese one; `../README.md` becomes `../../README.zh-CN.md`.
"""
from __future__ import annotations

import difflib
import os
import re
import sys
from pathlib import Path

from ddp_lab.engine.launch import ROOT

NOTEBOOKS = ROOT / "notebooks"
ZH = NOTEBOOKS / "zh"
LOCALE = ZH / "locale"
HEADER = {"Project-Id-Version": "ddp-lab", "Language": "zh_CN", "MIME-Version": "1.0",
          "Content-Type": "text/plain; charset=UTF-8", "Content-Transfer-Encoding": "8bit"}


def english() -> list[Path]:
    """Every English lesson and solution notebook, in name order."""
    return sorted(NOTEBOOKS.glob("[0-9]*.ipynb")) + sorted((NOTEBOOKS / "solutions").glob("[0-9]*.ipynb"))


def catalog_path(notebook: Path) -> Path:
    return LOCALE / f"{notebook.stem}.po"


def markdown_cells(notebook: Path) -> list[tuple[int, str]]:
    """(cell index, source) of every non-empty markdown cell."""
    import nbformat
    nb = nbformat.read(notebook, as_version=4)
    return [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.strip()]


def update(notebook: Path):
    """Bring the notebook's catalog in step with its markdown cells; returns the catalog (saved).

    A cell whose text is in the catalog keeps its entry. A new or changed cell gets an entry; when an
    old entry that no cell uses any more is close to it, its translation comes along marked fuzzy,
    with the old English kept as previous msgid, so a translator sees what changed."""
    import polib
    path = catalog_path(notebook)
    old = polib.pofile(str(path)) if path.exists() else polib.POFile()
    po = polib.POFile(wrapwidth=0)
    po.metadata = {**HEADER, **{k: v for k, v in old.metadata.items() if k not in HEADER}}
    by_id = {e.msgid: e for e in old if not e.obsolete}
    cells = markdown_cells(notebook)
    unused = [e for e in by_id.values() if e.msgid not in {s for _, s in cells} and e.msgstr]
    seen = set()
    for index, source in cells:
        if source in seen:  # the same text twice: one entry serves both cells
            continue
        seen.add(source)
        entry = polib.POEntry(msgid=source, msgstr="", comment=f"cell {index}")
        kept = by_id.get(source)
        if kept is not None:
            entry.msgstr, entry.flags = kept.msgstr, list(kept.flags)
            entry.previous_msgid = kept.previous_msgid
        else:
            near = _nearest(source, unused)
            if near is not None:
                unused.remove(near)
                entry.msgstr, entry.flags, entry.previous_msgid = near.msgstr, ["fuzzy"], near.msgid
        po.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    po.save(str(path))
    return po


def _nearest(source: str, candidates: list):
    best, score = None, 0.6  # below this the old text is another cell, not an edit of this one
    for entry in candidates:
        ratio = difflib.SequenceMatcher(None, entry.msgid, source, autojunk=False).ratio()
        if ratio > score:
            best, score = entry, ratio
    return best


def missing(notebook: Path) -> list[str]:
    """"cell N: first line" for every markdown cell without a current (non-fuzzy) translation."""
    import polib
    path = catalog_path(notebook)
    entries = {e.msgid: e for e in polib.pofile(str(path))} if path.exists() else {}
    out = []
    for index, source in markdown_cells(notebook):
        e = entries.get(source)
        why = "untranslated" if e is None or not e.msgstr else "fuzzy" if "fuzzy" in e.flags else None
        if why:
            out.append(f"cell {index} ({why}): {source.strip().splitlines()[0][:80]}")
    return out


TWINS = {"README.md": "README.zh-CN.md"}  # a file of the repository -> its Chinese edition
LINK = re.compile(r"(\]\(\s*<?)([^)\s>]+)"        # [text](target) and ![alt](target)
                  r"|((?:href|src)=[\"'])([^\"']+)"   # <a href="target">, <img src="target">
                  r"|(^\s*\[[^\]]+\]:\s*)(\S+)", re.M)  # [label]: target


def zh_path(notebook: Path) -> Path:
    """Where a notebook's Chinese edition goes: notebooks/zh/NN_x.ipynb, notebooks/zh/solutions/..."""
    return ZH / notebook.resolve().relative_to(NOTEBOOKS.resolve())


def relink(text: str, notebook: Path) -> str:
    """`text` (a cell of `notebook`) with each relative link made to resolve from its Chinese edition."""
    here, there = notebook.resolve().parent, zh_path(notebook).resolve().parent
    lessons = NOTEBOOKS.resolve()

    def target(link: str) -> str:
        path, sep, anchor = link.partition("#")
        if not path or re.match(r"^[a-z][a-z0-9+.-]*:|^/", path, re.I):  # an anchor, a URL, an absolute path
            return link
        goal = Path(os.path.normpath(here / path))
        if goal.suffix == ".ipynb" and goal.parent in (lessons, lessons / "solutions"):
            return link  # another lesson: the Chinese one, beside this one
        if goal.name in TWINS and (goal.parent / TWINS[goal.name]).exists():
            goal = goal.parent / TWINS[goal.name]
        return Path(os.path.relpath(goal, there)).as_posix() + sep + anchor

    def one(m: re.Match) -> str:
        for g in (1, 3, 5):
            if m.group(g) is not None:
                return m.group(g) + target(m.group(g + 1))
        return m.group(0)
    return LINK.sub(one, text)


def translated(notebook: Path, draft: bool = False) -> tuple[str, list[str]]:
    """(the Chinese notebook's file content, what `missing` says of it). Under `draft` a cell
    without a current translation keeps its English; otherwise the content is "" unless none is missing."""
    import nbformat
    import polib
    todo = missing(notebook)
    if todo and not draft:
        return "", todo
    path = catalog_path(notebook)
    done = {e.msgid: e.msgstr for e in polib.pofile(str(path))
            if e.msgstr and "fuzzy" not in e.flags and not e.obsolete} if path.exists() else {}
    nb = nbformat.read(notebook, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.strip():
            cell.source = relink(done.get(cell.source, cell.source), notebook)
    return nbformat.writes(nb) + "\n", todo  # as nbformat.write writes it: a rebuild gives the same bytes


def build(notebooks: list[Path], draft: bool = False) -> int:
    """Write the Chinese edition of `notebooks`; refuse (1, nothing written) where any is not fully
    translated, unless `draft`."""
    built = {nb: translated(nb, draft) for nb in notebooks}
    todo = {nb.stem: lines for nb, (_, lines) in built.items() if lines}
    if todo and not draft:
        print(f"notebooks/zh/ not built: {len(todo)} notebooks have markdown cells with no current "
              f"translation (untranslated, or fuzzy: the English changed):", file=sys.stderr)
        for stem, lines in todo.items():
            print(f"  {stem}:\n" + "\n".join(f"    {line}" for line in lines), file=sys.stderr)
        print("translate them in notebooks/zh/locale/<notebook>.po (`make zh-status` lists them), then "
              "`make zh`; to preview with English left in place: python -m ddp_lab.engine.zh build --draft",
              file=sys.stderr)
        return 1
    for nb, (text, _) in built.items():
        out = zh_path(nb)
        out.parent.mkdir(parents=True, exist_ok=True)
        if not out.exists() or out.read_text(encoding="utf-8") != text:
            out.write_text(text, encoding="utf-8")
    english_stems = {zh_path(nb) for nb in english()}
    for old in sorted(ZH.glob("*.ipynb")) + sorted(ZH.glob("solutions/*.ipynb")):
        if old not in english_stems:  # its English notebook is gone
            old.unlink()
    left = sum(len(lines) for lines in todo.values())
    print(f"wrote {len(built)} Chinese notebooks under {ZH.relative_to(ROOT)}"
          + (f" (draft: {left} cells still in English)" if left else ""))
    return 0


TERMS = ROOT / "docs" / "terms.json"


def merge_terms(files: list[Path]) -> list[str]:
    """Write the Chinese patterns of `files` ({term: {"definition": regex, "use": regex}}, the terms of
    docs/terms.json) into docs/terms.json as each term's zh_definition and zh_use. A term given in
    several files (translators of different lessons) gets the patterns of all, as alternatives.
    Returns the problems (an unknown term, a missing key, a pattern that does not compile); with
    any, nothing is written."""
    import json
    terms = json.loads(TERMS.read_text(encoding="utf-8"))
    problems, new = [], {}
    for file in files:
        for term, spec in json.loads(Path(file).read_text(encoding="utf-8")).items():
            if term not in terms or term.startswith("_"):
                problems.append(f"{file}: {term!r} is not a term of {TERMS.name}")
                continue
            if not isinstance(spec, dict) or set(spec) != {"definition", "use"}:
                problems.append(f"{file}: {term!r} needs exactly 'definition' and 'use'")
                continue
            for key, pattern in spec.items():
                try:
                    re.compile(pattern)
                except (re.error, TypeError) as e:
                    problems.append(f"{file}: {term!r} {key}: {e}")
            old = new.get(term, {"definition": [], "use": []})
            new[term] = {k: old[k] + [spec[k]] * (spec[k] not in old[k]) for k in old}
    new = {term: {k: _either(v) for k, v in spec.items()} for term, spec in new.items()}
    if not problems:
        for term, spec in new.items():
            terms[term].update(zh_definition=spec["definition"], zh_use=spec["use"])
        TERMS.write_text(json.dumps(terms, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return problems


def _either(patterns: list[str]) -> str:
    """One regular expression matching where any of `patterns` does; a leading (?i) stays with its own."""
    if len(patterns) == 1:
        return patterns[0]
    scoped = [re.sub(r"^\(\?([aiLmsux]+)\)(.*)$", r"(?\1:\2)", p, flags=re.S)
              if re.match(r"\(\?[aiLmsux]+\)", p) else f"(?:{p})" for p in patterns]
    return "|".join(scoped)


def main(argv: list[str]) -> int:
    draft = "--draft" in argv
    argv = [a for a in argv if a != "--draft"]
    command = argv[0] if argv else "status"
    chosen = [p for p in english() if not argv[1:] or any(p.stem.startswith(a) for a in argv[1:])]
    if command == "build":
        return build(chosen, draft)
    if command == "terms":
        problems = merge_terms([Path(f) for f in argv[1:]])
        print("\n".join(problems) or f"{len(argv) - 1} files merged into {TERMS.relative_to(ROOT)}",
              file=sys.stderr if problems else sys.stdout)
        return 1 if problems else 0
    if command == "update":
        for nb in chosen:
            update(nb)
        print(f"{len(chosen)} catalogs in step with the English under {LOCALE.relative_to(ROOT)}")
        return 0
    if command == "status":
        todo = {nb.stem: missing(nb) for nb in chosen}
        for stem, lines in todo.items():
            if lines:
                print(f"{stem}: {len(lines)} to translate")
                print("\n".join(f"  {line}" for line in lines))
        print("every markdown cell translated" if not any(todo.values()) else
              "translate these in the catalogs (notebooks/zh/locale/*.po), then: make zh")
        return 1 if any(todo.values()) else 0
    print("usage: python -m ddp_lab.engine.zh update|status|build [--draft] [notebook prefix ...] "
          "| terms FILE.json ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
