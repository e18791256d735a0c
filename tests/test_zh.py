"""The Chinese edition (notebooks/zh/), checked from files alone: nothing is executed.

First the machinery, on a tiny workbook in a temporary folder (catalogs follow the English, a stale
translation is refused, links are rewritten, code and outputs are carried over byte for byte); then
the real catalogs and notebooks: every cell translated and current, notebooks/zh/ what the build
makes, the glossary's terms and headings kept, and each term defined before its first use."""
import json
import re
from collections import Counter
from pathlib import Path

import nbformat
import polib
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

import test_lesson_budgets as budgets  # tests/: the English lessons' checks, whose helpers are reused here
from ddp_lab.engine import corepath, workbook, zh

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = (ROOT / "docs" / "glossary.zh.md").read_text(encoding="utf-8")
ENGLISH = zh.english()


# --- the machinery, on a tiny workbook -------------------------------------------------------------
LESSON = [
    new_markdown_cell("# 00 · A lesson\n\nSee [the guide](../docs/guide.md), [the program](first_ddp.py), "
                      "[next](01_next.ipynb), [its solutions](solutions/00_a_solutions.ipynb#1.-x), "
                      "[the README](../README.md#quick-start), [torch](https://pytorch.org/docs/) and [below](#2.-Two)."),
    new_code_cell("print(6 * 7)", execution_count=1,
                  outputs=[new_output("stream", name="stdout", text="42\n")]),
    new_markdown_cell("## 2. Two\n\nA second cell with `code` in it."),
    new_markdown_cell("## Exercises"),
]
SOLUTION = [new_markdown_cell("# Solutions\n\n[The lesson](../00_a.ipynb) and [a script](../../scripts/s.py)."),
            new_code_cell("x = 1")]
CHINESE = {
    LESSON[0].source: LESSON[0].source.replace("A lesson", "一课").replace("See", "见"),
    LESSON[2].source: "## 2. 第二节\n\n第二个单元格，含 `code`。",
    LESSON[3].source: "## 练习",
    SOLUTION[0].source: "# 答案\n\n[本课](../00_a.ipynb)与[脚本](../../scripts/s.py)。",
}


@pytest.fixture
def book(tmp_path, monkeypatch):
    """A workbook of one lesson and its solutions, with zh's folders pointing into it."""
    notebooks = tmp_path / "notebooks"
    (notebooks / "solutions").mkdir(parents=True)
    nbformat.write(new_notebook(cells=LESSON), notebooks / "00_a.ipynb")
    nbformat.write(new_notebook(cells=SOLUTION), notebooks / "solutions" / "00_a_solutions.ipynb")
    (tmp_path / "README.md").write_text("# English\n")
    (tmp_path / "README.zh-CN.md").write_text("# 中文\n")
    monkeypatch.setattr(zh, "ROOT", tmp_path)
    monkeypatch.setattr(zh, "NOTEBOOKS", notebooks)
    monkeypatch.setattr(zh, "ZH", notebooks / "zh")
    monkeypatch.setattr(zh, "LOCALE", notebooks / "zh" / "locale")
    return notebooks


def translate_all():
    for nb in zh.english():
        po = zh.update(nb)
        for entry in po:
            entry.msgstr = CHINESE[entry.msgid]
        po.save()


def test_update_makes_one_entry_per_markdown_cell(book):
    po = zh.update(book / "00_a.ipynb")
    assert [e.msgid for e in po] == [LESSON[0].source, LESSON[2].source, LESSON[3].source]
    assert all(e.msgstr == "" for e in po) and (book / "zh" / "locale" / "00_a.po").exists()
    assert len(zh.missing(book / "00_a.ipynb")) == 3


def test_build_replaces_markdown_rewrites_links_and_keeps_code_and_outputs(book, capsys):
    translate_all()
    assert zh.build(zh.english()) == 0
    lesson = nbformat.read(book / "zh" / "00_a.ipynb", as_version=4)
    english = nbformat.read(book / "00_a.ipynb", as_version=4)
    assert [c.source for c in lesson.cells if c.cell_type == "markdown"][1:] == ["## 2. 第二节\n\n第二个单元格，含 `code`。", "## 练习"]
    links = re.findall(r"\]\(([^)]+)\)", lesson.cells[0].source)
    assert links == ["../../docs/guide.md", "../first_ddp.py", "01_next.ipynb", "solutions/00_a_solutions.ipynb#1.-x",
                     "../../README.zh-CN.md#quick-start", "https://pytorch.org/docs/", "#2.-Two"]
    solution = nbformat.read(book / "zh" / "solutions" / "00_a_solutions.ipynb", as_version=4)
    assert re.findall(r"\]\(([^)]+)\)", solution.cells[0].source) == ["../00_a.ipynb", "../../../scripts/s.py"]
    same = lambda nb: [json.dumps(c, sort_keys=True) for c in nb.cells if c.cell_type == "code"]  # noqa: E731
    assert same(lesson) == same(english) and lesson.cells[1].outputs[0].text == "42\n"
    assert lesson.metadata == english.metadata and [c.id for c in lesson.cells] == [c.id for c in english.cells]


def test_a_rebuild_gives_the_same_bytes_and_an_untouched_notebook_its_english_bytes(book):
    translate_all()
    nbformat.write(new_notebook(cells=[new_code_cell("print(1)")]), book / "01_code.ipynb")
    assert zh.build(zh.english()) == 0
    first = {p: p.read_bytes() for p in (book / "zh").rglob("*.ipynb")}
    assert zh.build(zh.english()) == 0
    assert {p: p.read_bytes() for p in (book / "zh").rglob("*.ipynb")} == first and len(first) == 3
    assert (book / "zh" / "01_code.ipynb").read_bytes() == (book / "01_code.ipynb").read_bytes()


def test_a_changed_english_cell_turns_fuzzy_and_the_build_refuses_it(book, capsys):
    translate_all()
    nb = nbformat.read(book / "00_a.ipynb", as_version=4)
    nb.cells[2].source = "## 2. Two\n\nA second cell with `code` in it, and more."
    nbformat.write(nb, book / "00_a.ipynb")
    po = zh.update(book / "00_a.ipynb")
    (entry,) = [e for e in po if e.msgid == nb.cells[2].source]
    assert entry.fuzzy and entry.previous_msgid == LESSON[2].source and entry.msgstr == CHINESE[LESSON[2].source]
    assert zh.build(zh.english()) == 1
    err = capsys.readouterr().err
    assert "  00_a:\n    cell 2 (fuzzy): ## 2. Two\n" in err and "make zh-status" in err and "--draft" in err
    assert "00_a_solutions" not in err  # complete: not named
    assert not (book / "zh" / "00_a.ipynb").exists() and not (book / "zh" / "solutions").exists()
    assert zh.build(zh.english(), draft=True) == 0  # the preview keeps the English of the stale cell
    assert nbformat.read(book / "zh" / "00_a.ipynb", as_version=4).cells[2].source == nb.cells[2].source


def test_a_removed_cell_loses_its_entry_and_a_lost_notebook_its_edition(book):
    translate_all()
    assert zh.build(zh.english()) == 0
    nb = nbformat.read(book / "00_a.ipynb", as_version=4)
    del nb.cells[3]
    nbformat.write(nb, book / "00_a.ipynb")
    assert "## Exercises" not in [e.msgid for e in zh.update(book / "00_a.ipynb")]
    (book / "solutions" / "00_a_solutions.ipynb").unlink()
    assert zh.build(zh.english()) == 0
    assert not (book / "zh" / "solutions" / "00_a_solutions.ipynb").exists()


def test_the_workbook_renders_the_chinese_handouts_and_names_what_it_left_out(book, tmp_path):
    translate_all()
    nbformat.write(new_notebook(cells=[new_markdown_cell("# Untranslated")]), book / "01_new.ipynb")
    said = workbook.render_zh([book / "00_a.ipynb", book / "01_new.ipynb"], tmp_path / "out")
    assert "第二节" in (tmp_path / "out" / "zh" / "00_a.html").read_text()
    assert not (tmp_path / "out" / "zh" / "01_new.html").exists()
    assert said == ["no Chinese handout for 01_new: 1 cells not translated (make zh-status)",
                    f"wrote 1 Chinese handouts to {tmp_path / 'out' / 'zh'}/"]
    assert workbook.render_zh([tmp_path / "elsewhere.ipynb"], tmp_path / "out") == []


def test_the_merged_terms_land_in_terms_json_and_bad_ones_are_refused(tmp_path, monkeypatch):
    terms = tmp_path / "terms.json"
    terms.write_text(json.dumps({"_about": "x", "bucket": {"definition": "d", "use": "u"}}))
    monkeypatch.setattr(zh, "TERMS", terms)
    (tmp_path / "bad.json").write_text(json.dumps({"bucket": {"definition": "(", "use": "桶"}, "nope": {}}))
    problems = zh.merge_terms([tmp_path / "bad.json"])
    assert len(problems) == 2 and "'nope' is not a term" in problems[1] and "zh_use" not in terms.read_text()
    (tmp_path / "good.json").write_text(json.dumps({"bucket": {"definition": "bucket（梯度桶）", "use": "bucket"}}))
    assert zh.merge_terms([tmp_path / "good.json"]) == []
    assert json.loads(terms.read_text())["bucket"] == {"definition": "d", "use": "u",
                                                       "zh_definition": "bucket（梯度桶）", "zh_use": "bucket"}
    (tmp_path / "other.json").write_text(json.dumps({"bucket": {"definition": "(?i)桶：", "use": "bucket"}}))
    assert zh.merge_terms([tmp_path / "good.json", tmp_path / "other.json"]) == []
    merged = json.loads(terms.read_text())["bucket"]  # two translators' patterns: either one matches
    assert merged["zh_use"] == "bucket" and merged["zh_definition"] == "(?:bucket（梯度桶）)|(?i:桶：)"
    assert [bool(re.search(merged["zh_definition"], t)) for t in ("bucket（梯度桶）", "BUCKET", "桶：")] == [True, False, True]


def test_corepath_reads_the_chinese_structural_headings():
    cells = [new_markdown_cell("# 00 · 一课"), new_code_cell("a"), new_markdown_cell("## 深入：环的细节"),
             new_code_cell("b"), new_markdown_cell("### 在 GPU 集群上\n\n- 预期"), new_markdown_cell("## 练习"),
             new_code_cell("c")]
    assert corepath.parts(cells) == ["core", "core", "deep", "deep", "core", "exercises", "exercises"]
    assert corepath.deep_dives(cells) == ["环的细节"]
    assert corepath.parts([new_markdown_cell("## 深入 环"), new_markdown_cell("## 练习题")]) == ["core", "exercises"]


def test_lab_zh_has_the_labs_settings_and_a_chinese_locale():
    english = json.loads((ROOT / ".jupyter-lab" / "settings" / "overrides.json").read_text())
    chinese = json.loads((ROOT / ".jupyter-lab" / "zh" / "settings" / "overrides.json").read_text())
    assert chinese == {**english, "@jupyterlab/translation-extension:plugin": {"locale": "zh_CN"}}


# --- the real catalogs and the Chinese notebooks ---------------------------------------------------
def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("notebook", ENGLISH, ids=lambda p: p.stem)
def test_every_markdown_cell_has_a_current_translation(notebook):
    todo = zh.missing(notebook)
    assert not todo, (f"{rel(notebook)}: {len(todo)} markdown cells without a current translation in "
                      f"{rel(zh.catalog_path(notebook))} (`make zh-status` lists them all):\n  " + "\n  ".join(todo))


@pytest.mark.parametrize("notebook", ENGLISH, ids=lambda p: p.stem)
def test_the_chinese_notebook_is_what_the_build_makes(notebook):
    """Byte for byte: what `make zh` writes (here with English where a cell is not translated yet,
    which the test above reports) is what is committed; and its code cells are the English ones."""
    path = zh.zh_path(notebook)
    assert path.exists(), f"{rel(path)} is missing: make zh"
    text, _ = zh.translated(notebook, draft=True)
    assert path.read_text(encoding="utf-8") == text, f"{rel(path)} is stale: make zh"
    english, chinese = (json.loads(p.read_text(encoding="utf-8")) for p in (notebook, path))
    assert [c["cell_type"] for c in chinese["cells"]] == [c["cell_type"] for c in english["cells"]]
    assert [c for c in chinese["cells"] if c["cell_type"] != "markdown"] == \
           [c for c in english["cells"] if c["cell_type"] != "markdown"], f"{rel(path)}: code or outputs differ"
    assert chinese["metadata"] == english["metadata"]


def glossary_rows() -> list[list[str]]:
    """The rows of the glossary's term table (English, 译法, 不用, 说明), header and rule left out."""
    table = GLOSSARY.split("## 术语", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in rows]


AVOIDED = {bad.strip(): row[1] for row in glossary_rows() for bad in re.split(r"[,，、]", row[2]) if bad.strip()}
# A chosen form may hold a ruled-out one (低秩, low-rank, holds 秩): such chosen forms are read first.
CHOSEN = sorted({f.strip() for row in glossary_rows() for f in re.split(r"[/（）()]", row[1])
                 if any(bad in f for bad in AVOIDED)}, key=len, reverse=True)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK_TARGET = re.compile(r"\]\(\s*<?([^)\s>]+)|(?:href|src)=[\"']([^\"']+)")
HEADING = re.compile(r"^(#{1,6}) ", re.M)


def prose(text: str) -> str:
    return CODE_SPAN.sub("", FENCE.sub("", text))


def headings(text: str) -> list[str]:
    return [h for h in HEADING.findall(FENCE.sub("", text))]


def translations():
    for notebook in ENGLISH:
        path = zh.catalog_path(notebook)
        for e in polib.pofile(str(path)) if path.exists() else []:
            if e.msgstr and not e.fuzzy and not e.obsolete:
                yield notebook.stem, e


def test_the_glossary_table_parses():
    assert AVOIDED["全规约"] == "all-reduce" and AVOIDED["掉队者"] == "慢节点（straggler）" and len(AVOIDED) > 20
    assert "---" not in AVOIDED and "梯度" not in CHOSEN


def chosen_removed(text: str) -> str:
    for form in CHOSEN:
        text = text.replace(form, " ")
    return text


def test_no_translation_uses_a_form_the_glossary_rules_out():
    assert chosen_removed("梯度累积与梯度积累") == "梯度累积与梯度积累"  # no chosen form holds a ruled-out one today
    found = [f"{stem}, {e.comment}: {bad!r} (use {good!r}): "
             f"{next(line for line in e.msgstr.splitlines() if bad in line)[:70]!r}"
             for stem, e in translations() for bad, good in AVOIDED.items() if bad in chosen_removed(prose(e.msgstr))]
    assert not found, "forms docs/glossary.zh.md rules out:\n  " + "\n  ".join(found)


def test_each_translation_keeps_the_headings_fences_links_and_code_of_its_english():
    wrong = []
    for stem, e in translations():
        en, cn = e.msgid, e.msgstr
        checks = {"headings (#, ##, ...)": (headings(en), headings(cn)),
                  "``` fences": (en.count("```"), cn.count("```")),
                  "link targets": (sorted(t for m in LINK_TARGET.findall(en) for t in m if t),
                                   sorted(t for m in LINK_TARGET.findall(cn) for t in m if t)),
                  "code spans": (set(s for _, s in CODE_SPAN.findall(FENCE.sub("", en))),
                                 set(s for _, s in CODE_SPAN.findall(FENCE.sub("", cn))))}
        wrong += [f"{stem}, {e.comment} ({en.strip().splitlines()[0][:50]!r}): {what} {a!r} became {b!r}"
                  for what, (a, b) in checks.items() if a != b]
    assert not wrong, "translations that changed their cell's structure:\n  " + "\n  ".join(wrong)


def structural() -> list[tuple[str, str]]:
    """(English form, Chinese form) of the glossary's fixed structural headings, '...' left out."""
    table = GLOSSARY.split("## 课程结构用语", 1)[1]
    pairs = re.findall(r"^\| `([^`]+)`[^|]*\| `([^`]+)`", table, re.M)
    return [(a.replace("...", "").rstrip(), b.replace("...", "").rstrip()) for a, b in pairs if "Title" not in a]


STRUCTURAL = structural()


def test_the_structural_headings_use_the_glossarys_chinese_forms():
    assert ("## Deep dive:", "## 深入：") in STRUCTURAL and ("## Exercises", "## 练习") in STRUCTURAL
    wrong = []
    for stem, e in translations():
        for en, cn in STRUCTURAL:
            want = len(re.findall(rf"^{re.escape(en)}", e.msgid, re.M))
            if want and len(re.findall(rf"^{re.escape(cn)}", e.msgstr, re.M)) != want:
                wrong.append(f"{stem}, {e.comment}: {en!r} must read {cn!r}")
        numbers = re.findall(r"^(#+ \d+\. )", e.msgid, re.M)
        if numbers != re.findall(r"^(#+ \d+\. )", e.msgstr, re.M):
            wrong.append(f"{stem}, {e.comment}: numbered headings {numbers} must keep their numbers")
    assert not wrong, "structural headings (docs/glossary.zh.md, 课程结构用语):\n  " + "\n  ".join(wrong)


# --- defined before use, in the Chinese lessons -----------------------------------------------------
ZH_LESSONS = [zh.ZH / name for name in budgets.ORDER]


def first_zh(pattern: str, where: str):
    """test_lesson_budgets.first over the Chinese lessons, in the README's order."""
    regex = re.compile(pattern)
    for n, path in enumerate(ZH_LESSONS):
        for i, cell in enumerate(budgets.cells(path)):
            if where == "definition" and cell["cell_type"] != "markdown":
                continue
            if any(regex.search(t) for t in budgets.texts(cell)):
                return n, i, path.name
    return None


def test_every_term_has_its_chinese_patterns():
    lacking = sorted(t for t, spec in budgets.TERMS.items() if not {"zh_definition", "zh_use"} <= set(spec))
    assert not lacking, ("terms without 'zh_definition'/'zh_use' in docs/terms.json (merge them with "
                         "python -m ddp_lab.engine.zh terms FILE.json): " + ", ".join(lacking))


@pytest.mark.parametrize("term", sorted(budgets.TERMS))
def test_each_term_is_defined_before_it_is_used_in_chinese(term):
    spec = budgets.TERMS[term]
    if "zh_use" not in spec:
        pytest.fail(f"{term!r} has no zh_definition/zh_use in docs/terms.json")
    missing = [rel(p) for p in ZH_LESSONS if not p.exists()]
    assert not missing, f"no Chinese lessons to search: make zh ({', '.join(missing)})"
    use, definition = first_zh(spec["zh_use"], "use"), first_zh(spec["zh_definition"], "definition")
    assert use is not None, f"{term!r} is used in no Chinese lesson: fix its 'zh_use' pattern"
    assert definition is not None, f"{term!r} is used in zh/{use[2]} (cell {use[1]}) but never defined in Chinese"
    assert definition[:2] <= use[:2], (
        f"{term!r} is first used in zh/{use[2]}, cell {use[1]}, but defined only in zh/{definition[2]}, "
        f"cell {definition[1]}: define it at or before its first use")


def test_the_chinese_order_check_catches_a_use_before_the_definition():
    if not ZH_LESSONS[0].exists():
        pytest.fail("no Chinese lessons: make zh")
    assert first_zh(r"\A# 00 ", "use")[:2] == (0, 0)
    assert first_zh(r"\A# 01 ", "definition")[:2] == (1, 0)
    assert first_zh(r"(?!x)x", "use") is None


def test_the_chinese_readme_links_the_chinese_lessons():
    text = (ROOT / "README.zh-CN.md").read_text(encoding="utf-8")
    linked = re.findall(r"\]\((notebooks/zh/[0-9][^)#]*\.ipynb)\)", text)
    assert sorted(set(linked)) == sorted(rel(zh.zh_path(p)) for p in ENGLISH if p.parent == zh.NOTEBOOKS), \
        "README.zh-CN.md's notebook map links each Chinese lesson (notebooks/zh/NN_x.ipynb)"
    assert "make lab-zh" in text
