"""`make workbook`: executed HTML handouts and an index with timings; failures are named."""
import datetime
import json
import os

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from ddp_lab.engine import workbook


def _write(path, code):
    nb = new_notebook(cells=[new_markdown_cell("# A tiny lesson"), new_code_cell(code)],
                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(nb, path)


def test_renders_executed_html_and_names_a_failing_notebook(tmp_path, monkeypatch, capsys):
    src = tmp_path / "notebooks"
    (src / "solutions").mkdir(parents=True)
    _write(src / "00_ok.ipynb", "print(6 * 7)")
    _write(src / "01_bad.ipynb", "assert 1 == 2, 'the claim does not hold'")
    monkeypatch.setattr(workbook, "NOTEBOOKS", src)
    out = tmp_path / "html"
    assert workbook.main([str(out)]) == 1
    assert "42" in (out / "00_ok.html").read_text()  # executed, not just converted
    assert (out / "01_bad.html").exists()
    run = json.loads((out / "timings.json").read_text())
    timings = run["notebooks"]
    assert timings["00_ok.ipynb"]["ok"] and not timings["01_bad.ipynb"]["ok"]
    assert timings["00_ok.ipynb"]["title"] == "A tiny lesson" and timings["00_ok.ipynb"]["seconds"] > 0
    assert run["machine"]["cores"] == os.cpu_count() and run["machine"]["torch"] == str(torch.__version__)
    assert run["date"] == datetime.date.today().isoformat()
    assert "01_bad.ipynb" in capsys.readouterr().err
    assert "00_ok.html" in (out / "index.html").read_text()


def test_make_workbook_end_to_end_on_a_real_notebook(tmp_path):
    """What `make workbook` runs, in its own process, on a real notebook of the workbook (a short one)."""
    import subprocess
    import sys
    from pathlib import Path

    name = "10_laptop_to_cluster_solutions.ipynb"
    src = tmp_path / "notebooks"
    (src / "solutions").mkdir(parents=True)
    nb = nbformat.read(workbook.NOTEBOOKS / "solutions" / name, as_version=4)
    for cell in nb.cells:                     # no stored outputs: what the page shows, execution made
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.write(nb, src / "solutions" / name)
    out = tmp_path / "build" / "workbook"
    code = ("import sys; from pathlib import Path; from ddp_lab.engine import workbook; "
            "workbook.NOTEBOOKS = Path(sys.argv[1]); sys.exit(workbook.main(sys.argv[2:]))")
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True,
                          timeout=600, cwd=Path(workbook.__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (out / name.replace(".ipynb", ".html")).read_text()
    assert "DDP101" in page                   # an output only a real execution of the cells prints
    (timing,) = json.loads((out / "timings.json").read_text())["notebooks"].values()
    assert timing["ok"] and timing["seconds"] > 0 and timing["title"] == "10 · Solutions"
    assert name.replace(".ipynb", ".html") in (out / "index.html").read_text()


def test_store_writes_outputs_back_and_leaves_a_failing_notebook_as_it_was(tmp_path, capsys):
    """`make workbook` stores outputs: lessons and solutions executed in one pass."""
    ok, bad = tmp_path / "00_ok.ipynb", tmp_path / "01_bad.ipynb"
    _write(ok, "print(6 * 7)")
    _write(bad, "assert 1 == 2, 'the claim does not hold'")
    before = bad.read_bytes()
    assert workbook.main([str(tmp_path / "html"), "--store", str(ok), str(bad)]) == 1
    (cell,) = [c for c in nbformat.read(ok, as_version=4).cells if c.cell_type == "code"]
    assert cell.outputs and cell.outputs[0]["text"].strip() == "42" and cell.execution_count == 1
    assert bad.read_bytes() == before                     # a failed run never overwrites stored outputs
    assert workbook.main([str(tmp_path / "html"), str(tmp_path / "missing.ipynb")]) == 2
    assert "no such notebook" in capsys.readouterr().err


GUIDE = """# Workshop

Some prose that stays.

<!-- timings:start -->
| notebook | topic | executes in | measured on |
|---|---|---|---|
| 00 | ok lesson | 12 s | 2026-01-01, 8 cores, Linux, torch 2.0 |
| 01 | bad lesson | 34 s | 2026-01-01, 8 cores, Linux, torch 2.0 |
| 01b | not run | — | — |
| 02 | ok, not measured yet | — | — |
<!-- timings:end -->

Prose after the table that stays.
"""


def test_workshop_timing_table_rewritten_for_lessons_that_passed(tmp_path, capsys):
    """`--workshop`: rows of lessons that ran and passed get their time; failed and unrun rows keep theirs."""
    nbs = tmp_path / "notebooks"
    (nbs / "solutions").mkdir(parents=True)
    _write(nbs / "00_ok.ipynb", "print(6 * 7)")
    _write(nbs / "01_bad.ipynb", "assert 1 == 2, 'the claim does not hold'")
    _write(nbs / "02_ok.ipynb", "print(1)")
    _write(nbs / "09b_new.ipynb", "print(2)")             # a lesson the guide has no row for yet
    _write(nbs / "solutions" / "00_ok_solutions.ipynb", "print(3)")
    guide = tmp_path / "workshop.md"
    guide.write_text(GUIDE)
    paths = [str(p) for p in (nbs / "00_ok.ipynb", nbs / "01_bad.ipynb", nbs / "02_ok.ipynb",
                              nbs / "09b_new.ipynb", nbs / "solutions" / "00_ok_solutions.ipynb")]
    assert workbook.main([str(tmp_path / "html"), "--workshop", str(guide), *paths]) == 1
    text = guide.read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| 0")}
    run = json.loads((tmp_path / "html" / "timings.json").read_text())
    where = f"{run['date']}, {os.cpu_count()} cores, {run['machine']['platform']}, torch {run['machine']['torch']}"
    for key, name in (("00", "00_ok.ipynb"), ("02", "02_ok.ipynb"), ("09b", "09b_new.ipynb")):
        assert rows[key][2] == f"{run['notebooks'][name]['seconds']:.0f} s" and rows[key][4] == where
        assert rows[key][3] == f"{run['notebooks'][name]['core_seconds']:.0f} s"   # no deep dive: all core
    assert rows["00"][1] == "ok lesson" and rows["09b"][1] == "A tiny lesson"   # topics kept; a new row titled
    # failed or not run: kept, with the core-path column the older table had not
    assert rows["01"] == ["01", "bad lesson", "34 s", "—", "2026-01-01, 8 cores, Linux, torch 2.0"]
    assert rows["01b"] == ["01b", "not run", "—", "—", "—"]
    assert list(rows) == ["00", "01", "01b", "02", "09b"]          # in teaching order
    assert text.startswith("# Workshop\n\nSome prose that stays.\n\n<!-- timings:start -->\n"
                           + "\n".join(workbook.TABLE_HEADER) + "\n")
    assert text.endswith("<!-- timings:end -->\n\nProse after the table that stays.\n")
    assert workbook.update_timing_table(text, {**run, "notebooks": {}}) == text    # idempotent, nothing new
    assert "timing table" in capsys.readouterr().out


def test_workshop_without_markers_fails_before_executing_anything(tmp_path, capsys, monkeypatch):
    guide = tmp_path / "workshop.md"
    guide.write_text("# Workshop without a table\n")
    monkeypatch.setattr(workbook, "render", lambda *a, **k: pytest.fail("executed a notebook"))
    nb = tmp_path / "00_ok.ipynb"
    _write(nb, "print(1)")
    assert workbook.main([str(tmp_path / "html"), "--workshop", str(guide), str(nb)]) == 2
    assert "timings:start" in capsys.readouterr().err
    assert guide.read_text() == "# Workshop without a table\n"


def test_help_executes_nothing_and_a_notebook_given_as_output_folder_is_refused(tmp_path, capsys, monkeypatch):
    from ddp_lab.engine import workbook
    monkeypatch.chdir(tmp_path)
    assert workbook.main(["--help"]) == 0
    assert "--store" in capsys.readouterr().out
    assert workbook.main(["notebooks/00_first_launch.ipynb"]) == 2
    assert "the first argument is the output folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no folder named after a flag or a notebook


def test_stored_widgets_are_the_sentence_their_cell_shows_until_it_runs():
    """A stored widget draws only in a trusted lab, only once its manager has caught up, and then
    cannot redraw: every lab (and GitHub) must show the same sentence instead."""
    from nbformat.v4 import new_output
    view = {"model_id": "m1", "version_major": 2, "version_minor": 0}
    nb = new_notebook(cells=[new_code_cell("w()", outputs=[new_output(
        "execute_result", {workbook.WIDGET_VIEW: view, "text/plain": "VBox(children=(IntSlider(value=1),))"})]),
        new_code_cell("s()", outputs=[new_output(
            "display_data", {workbook.WIDGET_VIEW: view, "text/plain": "Stepper: run this cell"})]),
        new_code_cell("print(1)", outputs=[new_output("stream", text="1\n")])],
        metadata={"widgets": {"application/vnd.jupyter.widget-state+json": {"state": {}}}})
    out = workbook.stored_widgets_as_text(nb)
    assert [c.outputs[0].get("data") for c in out.cells[:2]] == [
        {"text/plain": workbook.WIDGET_TEXT}, {"text/plain": "Stepper: run this cell"}]
    assert out.cells[2].outputs[0].text == "1\n" and "widgets" not in out.metadata


def test_stored_notebooks_hold_no_widget_view_and_each_widget_cell_says_run_it():
    from conftest import widget_cells  # tests/conftest.py
    cells = widget_cells()
    assert len(cells) >= 3, cells  # 03's stepper, 08's and 09's calculators
    for path in sorted((workbook.NOTEBOOKS).rglob("*.ipynb")):
        if ".ipynb_checkpoints" in path.parts:  # JupyterLab's own copies, not the workbook's
            continue
        nb = nbformat.read(path, as_version=4)
        assert workbook.WIDGET_STATE not in nb.metadata, f"{path.name} stores widget state"
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                assert workbook.WIDGET_VIEW not in out.get("data", {}), f"{path.name} stores a widget view"
    for rel, index in cells:
        outputs = nbformat.read(workbook.ROOT / rel, as_version=4).cells[index].outputs
        shown = " ".join(str(o.get("data", {}).get("text/plain", "")) for o in outputs)
        assert "to use the controls" in shown or workbook.WIDGET_TEXT in shown, (rel, index, shown[:120])


def test_the_core_path_and_the_deep_dives_are_timed_apart(tmp_path, capsys):
    """A lesson's deep dive (`## Deep dive: ...`) is timed apart from its core path, in timings.json
    and in what the run prints; exercises count in neither."""
    nb = new_notebook(cells=[
        new_markdown_cell("# A lesson"), new_code_cell("print('core')"),
        new_markdown_cell("## Deep dive: something slow"), new_code_cell("import time; time.sleep(0.5)"),
        new_markdown_cell("### On a GPU cluster\n\n- expected"), new_code_cell("print('closing')"),
        new_markdown_cell("## Exercises"), new_code_cell("import time; time.sleep(0.5)")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    path = tmp_path / "03_lesson.ipynb"
    nbformat.write(nb, path)
    assert workbook.main([str(tmp_path / "html"), str(path)]) == 0
    (t,) = json.loads((tmp_path / "html" / "timings.json").read_text())["notebooks"].values()
    assert t["deep_seconds"] >= 0.5 > t["core_seconds"] >= 0          # the sleep is in the deep dive only
    assert t["core_seconds"] + t["deep_seconds"] <= t["seconds"]     # the exercises' sleep in neither
    assert f"03_lesson: {t['seconds']:.0f} s, core path {t['core_seconds']:.0f} s, " \
           f"deep dives {t['deep_seconds']:.0f} s" in capsys.readouterr().out


def test_only_a_stored_run_refreshes_the_records_the_notebooks_ship(tmp_path):
    """A learner's run of 03 writes its fit into runs/; the stored build (--store) writes notebooks/records/."""
    nb = tmp_path / "00_env.ipynb"
    _write(nb, "import os; print('flag=' + os.environ.get('DDP_LAB_STORE_RECORDS', 'unset'))")
    assert workbook.main([str(tmp_path / "html"), str(nb)]) == 0
    assert "flag=unset" in (tmp_path / "html" / "00_env.html").read_text()
    assert workbook.main([str(tmp_path / "html2"), "--store", str(nb)]) == 0
    assert "flag=1" in "".join(o.get("text", "") for c in nbformat.read(nb, 4).cells for o in c.get("outputs", []))
    assert "DDP_LAB_STORE_RECORDS" not in os.environ  # restored after the run
