"""`ddp-lab check` over several files when one of them cannot be analysed (a syntax error, an
expression too deep for Python's parser): that file is one error line, the exit status is 2, and
the other files' findings are still printed; `--format json` and `--format sarif` always print
their document, with the errors in it."""
import json

import pytest

from ddp_lab import cli

BROKEN = 'import torch.distributed as dist\ndist.init_process_group(backend="gloo")\n'   # DDP002: no timeout
DEEP = "x = " + " + ".join(["1"] * 5000) + "\n"


def run(capsys, *argv):
    rc = cli.main(["check", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "a_deep.py").write_text(DEEP)
    (tmp_path / "b_train.py").write_text(BROKEN)
    (tmp_path / "c_typo.py").write_text("def f(:\n    pass\n")
    return tmp_path


def test_unanalysable_files_are_one_line_each_and_the_others_findings_are_kept(capsys, tree):
    rc, out, err = run(capsys, tree)
    assert rc == 2
    assert "b_train.py:2:1: DDP002" in out and "1 finding in 1 file (1 file checked)" in out
    lines = err.splitlines()
    assert len(lines) == 2 and "Traceback" not in err
    assert lines[0].startswith(f"{tree / 'a_deep.py'}: error: nested too deeply to analyse")
    assert "split the expression" in lines[0]
    assert lines[1] == f"{tree / 'c_typo.py'}: error: cannot parse as Python: invalid syntax (line 1)"


def test_the_deep_file_alone_is_checked_apart_from_a_project_too(capsys, tree):
    rc, out, err = run(capsys, tree / "a_deep.py")
    assert rc == 2 and out == "" and "nested too deeply to analyse" in err and "Traceback" not in err


def test_json_keeps_findings_and_lists_the_errors(capsys, tree):
    rc, out, _ = run(capsys, "--format", "json", tree)
    doc = json.loads(out)
    assert rc == 2 and doc["files_checked"] == 1
    assert [f["id"] for f in doc["findings"]] == ["DDP002"]
    assert [e["path"].rsplit("/", 1)[-1] for e in doc["errors"]] == ["a_deep.py", "c_typo.py"]


@pytest.mark.parametrize("fmt", ["json", "sarif"])
def test_a_document_is_printed_when_no_file_could_be_checked(capsys, tree, fmt):
    rc, out, err = run(capsys, "--format", fmt, tree / "c_typo.py")
    doc = json.loads(out)
    assert rc == 2 and "no file was checked" in err
    if fmt == "json":
        assert doc["findings"] == [] and doc["files_checked"] == 0
        assert doc["errors"][0]["message"].startswith("cannot parse as Python")
    else:
        [invocation] = doc["runs"][0]["invocations"]
        assert doc["runs"][0]["results"] == [] and invocation["executionSuccessful"] is False
        assert "cannot parse as Python" in invocation["toolExecutionNotifications"][0]["message"]["text"]


def test_json_for_a_folder_with_nothing_to_check_says_why(capsys, tmp_path):
    (tmp_path / "notes.md").write_text("# notes")
    rc, out, _ = run(capsys, "--format", "json", tmp_path)
    doc = json.loads(out)
    assert rc == 2 and doc["files_checked"] == 0 and "holds no .py" in doc["errors"][0]["message"]


def test_a_clean_project_beside_a_broken_one_is_still_exit_1_without_errors(capsys, tree):
    (tree / "a_deep.py").unlink()
    (tree / "c_typo.py").unlink()
    rc, out, err = run(capsys, "--format", "json", tree)
    assert rc == 1 and json.loads(out)["errors"] == [] and err == ""


def test_a_checker_failure_on_one_file_is_one_error_line_and_the_others_are_kept(capsys, tree, monkeypatch):
    from ddp_lab import check
    real = check.check_file

    def failing(path, *args):
        if path.name == "b_train.py":
            raise KeyError("boom")
        return real(path, *args)
    monkeypatch.setattr(check, "check_file", failing)
    (tree / "d_train.py").write_text(BROKEN)
    rc, out, err = run(capsys, tree)
    assert rc == 2 and "d_train.py:2:1: DDP002" in out and "Traceback" not in err
    assert f"{tree / 'b_train.py'}: error: could not be analysed (KeyError: 'boom'); please report it" in err
