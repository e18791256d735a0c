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
