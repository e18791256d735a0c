"""`make workbook`: executed HTML handouts and an index with timings; failures are named."""
import json

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from ddp_lab import workbook


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
    timings = {t["notebook"]: t for t in json.loads((out / "timings.json").read_text())}
    assert timings["00_ok.ipynb"]["ok"] and not timings["01_bad.ipynb"]["ok"]
    assert timings["00_ok.ipynb"]["title"] == "A tiny lesson"
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
    code = ("import sys; from pathlib import Path; from ddp_lab import workbook; "
            "workbook.NOTEBOOKS = Path(sys.argv[1]); sys.exit(workbook.main(sys.argv[2:]))")
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True,
                          timeout=600, cwd=Path(workbook.__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (out / name.replace(".ipynb", ".html")).read_text()
    assert "DDP101" in page                   # an output only a real execution of the cells prints
    (timing,) = json.loads((out / "timings.json").read_text())
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
