"""`ddp-lab grade` prints grade.progress() from the grades file, and says what to do with a bad one."""
import json

import pytest

from ddp_lab import cli, grade
from ddp_lab.grade import store


@pytest.fixture
def grades_file(tmp_path, monkeypatch):
    path = tmp_path / "grades.json"
    monkeypatch.setenv(store.GRADES_ENV, str(path))
    return path


def test_prints_each_notebooks_passes(grades_file, capsys):
    store.record(grade.REGISTRY["04.4"], True)
    store.record(grade.REGISTRY["10.5"], False)
    assert cli.main(["grade"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("04_mixed_precision"))
    assert "1/2 passed" in line and "04.4 ✓" in line and "04.5 ·" in line
    assert "10.5 ✗" in out and str(grades_file) in out


def test_json_lists_every_registered_exercise(grades_file, capsys):
    store.record(grade.REGISTRY["08.4"], True)
    assert cli.main(["grade", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["08_profiling"]["08.4"] == "passed"
    assert {e for states in table.values() for e in states} == set(grade.REGISTRY)


def test_unreadable_file_one_message_exit_2_nothing_overwritten(grades_file, capsys):
    grades_file.write_text("{broken")
    assert cli.main(["grade"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "delete it or point DDP_LAB_GRADES" in err and "Traceback" not in err
    assert grades_file.read_text() == "{broken"
