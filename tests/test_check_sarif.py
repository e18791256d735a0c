"""`ddp-lab check --format sarif`: a SARIF 2.1.0 log GitHub code scanning accepts: the required
keys, every rule described, one result per finding at the finding's place, relative paths."""
import json

import pytest

from ddp_lab import check, cli

BROKEN_PY = 'import torch.distributed as dist\ndist.init_process_group("nccl")\n'
BROKEN_SH = "#SBATCH --gres=gpu:4\ntorchrun --nproc_per_node=8 train.py\n"
NOTEBOOK = json.dumps({"cells": [{"cell_type": "markdown", "source": "# title"},
                                 {"cell_type": "code", "source": "import torch\nscaler = torch.cuda.amp.GradScaler()"}]})

# The parts of the SARIF 2.1.0 schema (sarif-schema-2.1.0.json) a log must satisfy for these fields.
SCHEMA = {
    "type": "object", "required": ["version", "runs"],
    "properties": {
        "version": {"const": "2.1.0"},
        "runs": {"type": "array", "items": {
            "type": "object", "required": ["tool"],
            "properties": {
                "tool": {"type": "object", "required": ["driver"], "properties": {"driver": {
                    "type": "object", "required": ["name"], "properties": {"rules": {"type": "array", "items": {
                        "type": "object", "required": ["id"], "properties": {
                            "shortDescription": {"type": "object", "required": ["text"]},
                            "help": {"type": "object", "required": ["text"]}}}}}}}},
                "results": {"type": "array", "items": {
                    "type": "object", "required": ["message"], "properties": {
                        "ruleId": {"type": "string"}, "ruleIndex": {"type": "integer", "minimum": 0},
                        "level": {"enum": ["none", "note", "warning", "error"]},
                        "message": {"type": "object", "required": ["text"]},
                        "locations": {"type": "array", "items": {"type": "object", "properties": {
                            "physicalLocation": {"type": "object", "required": ["artifactLocation"], "properties": {
                                "artifactLocation": {"type": "object", "required": ["uri"]},
                                "region": {"type": "object", "properties": {
                                    "startLine": {"type": "integer", "minimum": 1},
                                    "startColumn": {"type": "integer", "minimum": 1}}}}}}}}}}}}}}},
}


def run(capsys, *argv):
    rc = cli.main(["check", *map(str, argv)])
    return rc, capsys.readouterr().out


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(BROKEN_PY)
    (tmp_path / "src" / "job.sbatch").write_text(BROKEN_SH)
    (tmp_path / "lesson.ipynb").write_text(NOTEBOOK)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_sarif_log_has_the_required_structure_and_one_result_per_finding(capsys, project):
    rc, out = run(capsys, "--format", "sarif", ".")
    log = json.loads(out)
    rc_json, out_json = run(capsys, "--format", "json", ".")
    findings = json.loads(out_json)["findings"]
    assert rc == rc_json == 1 and len(findings) == 4

    assert log["version"] == "2.1.0" and log["$schema"].endswith("sarif-2.1.0.json") and len(log["runs"]) == 1
    run_ = log["runs"][0]
    rules = run_["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == sorted(check.RULES)
    for r in rules:
        assert r["shortDescription"]["text"] == check.RULES[r["id"]].sentence
        assert check.RULES[r["id"]].fix in r["help"]["text"]

    results = run_["results"]
    assert len(results) == len(findings)
    for result, f in zip(results, findings):
        assert result["ruleId"] == f["id"] == rules[result["ruleIndex"]]["id"]
        assert result["level"] == "warning" and f["message"] in result["message"]["text"]
        loc = result["locations"][0]["physicalLocation"]
        uri = loc["artifactLocation"]["uri"]
        assert not uri.startswith(("/", "file:")) and "\\" not in uri and (project / uri).is_file()
        assert uri == f["path"].removeprefix("./").replace("\\", "/")
        if f["cell"] is None:
            assert (loc["region"]["startLine"], loc["region"]["startColumn"]) == (f["line"], f["col"])
        else:  # a notebook: the file, and the cell and line in the message
            assert result["properties"] == {"cell": 2, "lineInCell": 2, "columnInCell": 10}
            assert result["message"]["text"].startswith("cell 2, line 2: ")
    assert {r["ruleId"] for r in results} == {"DDP001", "DDP002", "DDP012", "DDP106"}
    assert run_["invocations"][0]["executionSuccessful"] is True


def test_sarif_log_validates_against_the_schema_parts_it_uses(capsys, project):
    jsonschema = pytest.importorskip("jsonschema")
    log = json.loads(run(capsys, "--format", "sarif", ".")[1])
    jsonschema.validate(log, SCHEMA)
    log["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]["startLine"] = 0
    with pytest.raises(jsonschema.ValidationError):   # the schema part can fail
        jsonschema.validate(log, SCHEMA)


def test_unreadable_files_are_tool_notifications_and_exit_2(capsys, project):
    (project / "broken.py").write_text("def f(:\n")
    rc, out = run(capsys, "--format", "sarif", "broken.py", "src/train.py")
    log = json.loads(out)
    invocation = log["runs"][0]["invocations"][0]
    assert rc == 2 and invocation["executionSuccessful"] is False
    assert [n["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for n in
            invocation["toolExecutionNotifications"]] == ["broken.py"]
    assert [r["ruleId"] for r in log["runs"][0]["results"]] == ["DDP002", "DDP001"]


def test_a_clean_project_gives_an_empty_result_list(capsys, tmp_path, monkeypatch):
    (tmp_path / "ok.py").write_text("import torch\n")
    monkeypatch.chdir(tmp_path)
    rc, out = run(capsys, "--format", "sarif", "ok.py")
    assert rc == 0 and json.loads(out)["runs"][0]["results"] == []
