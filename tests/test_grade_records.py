"""Each learner's grades are their own: the tests, the workbook build and the solution notebooks
keep their verdicts out of ~/.ddp_lab/grades.json; grade.progress() shows its table once."""
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from ddp_lab import grade
from ddp_lab.engine import workbook
from ddp_lab.grade import store

ROOT = Path(__file__).resolve().parents[1]
RING_BYTES = '''
def ring_bytes(numel, n):
    sizes = [numel // n + (1 if i < numel % n else 0) for i in range(n)]
    return [4 * (2 * numel - sizes[(r + 1) % n] - sizes[(r + 2) % n]) for r in range(n)]
'''
SOLUTION_CELL = "from ddp_lab import grade\n" + RING_BYTES + 'assert grade.check("03.6", ring_bytes).passed\n'


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A learner's home folder, with no grades file yet."""
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("HOME", str(path))
    return path


def test_a_solution_graded_under_the_tests_leaves_the_home_grades_alone(home):
    run = subprocess.run([sys.executable, "-c", SOLUTION_CELL], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "03.6" in run.stdout and "passed" in run.stdout
    assert not (home / ".ddp_lab").exists()
    scratch = Path(os.environ[store.GRADES_ENV])  # the session's, from conftest.py
    assert home not in scratch.parents and json.loads(scratch.read_text())["03.6"]["passed"]


def test_the_workbook_build_keeps_the_solutions_verdicts_beside_the_handouts(home, tmp_path, monkeypatch):
    monkeypatch.delenv(store.GRADES_ENV)  # as `make workbook` runs: nothing set
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SOLUTION_CELL)])
    path = tmp_path / "03_ring_allreduce_solutions.ipynb"
    nbformat.write(nb, path)
    out = tmp_path / "handouts"
    out.mkdir()
    _, _, error, _ = workbook.render(path, out)
    assert error is None
    assert not (home / ".ddp_lab").exists()
    assert json.loads((out / "grades.json").read_text())["03.6"]["passed"]
    assert store.GRADES_ENV not in os.environ  # the build's setting ends with the kernel


def test_a_solution_notebook_opened_in_the_lab_keeps_no_verdict(tmp_path, monkeypatch):
    grades = tmp_path / "grades.json"
    monkeypatch.setenv(store.GRADES_ENV, str(grades))
    namespace: dict = {}
    exec(RING_BYTES, namespace)
    monkeypatch.setenv("JPY_SESSION_NAME", str(ROOT / "notebooks/solutions/03_ring_allreduce_solutions.ipynb"))
    assert grade.check("03.6", namespace["ring_bytes"]).passed
    assert not grades.exists()
    monkeypatch.setenv("JPY_SESSION_NAME", str(ROOT / "notebooks/03_ring_allreduce.ipynb"))  # the lesson
    assert grade.check("03.6", namespace["ring_bytes"]).passed
    assert json.loads(grades.read_text())["03.6"]["passed"]


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell
    ip = InteractiveShell.instance()
    yield ip
    InteractiveShell.clear_instance()


def test_progress_at_the_end_of_a_cell_shows_its_table_once(tmp_path, monkeypatch, shell, capsys):
    monkeypatch.setenv(store.GRADES_ENV, str(tmp_path / "grades.json"))
    store.record(grade.REGISTRY["05.4"], True)
    shell.run_cell("from ddp_lab import grade\ngrade.progress()", store_history=True)
    out = capsys.readouterr().out
    assert out.count("05_gradient_accumulation") == 1, out
    assert out.count("kept in") == 1 and "'passed'" not in out and "Out[" not in out, out
