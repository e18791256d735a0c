"""ddp-lab verify end to end on what its unit tests cannot launch: a training set that is a Subset
(clean, and the clean report says what it checked), a relaunch that does not resume because the
script's own --resume flag is missing. (The script lines that findings name are tests/test_verify.py's,
on the verifies it runs anyway.)

Three verifies (seven 2-rank launches, tiny data, gloo), two at a time, shared by the tests below."""
import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "verify_scripts"
RUNS = {  # key: (script, verify's options, the script's own ARGS)
    "good_subset": ("good_subset", ["--steps", "4"], []),
    "bad_resume_flag": ("bad_resume_flag", ["--steps", "3", "--resume"], []),
    "resume_flag_given": ("bad_resume_flag", ["--steps", "3", "--resume"], ["--resume"]),
}


def _verify(key):
    """(JSON report, text report) of `ddp-lab verify [options] --json -- tests/verify_scripts/NAME.py [ARGS]`."""
    from ddp_lab.verify import command
    name, options, args = RUNS[key]
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    report = command.report_for(parser.parse_args([*options, "--json", "--", str(HERE / f"{name}.py"), *args]))
    return json.loads(json.dumps(report.to_dict())), report.text()


@pytest.fixture(scope="module")
def verified():
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(RUNS, pool.map(_verify, RUNS)))


def line_of(name, words):
    """path:line of the first line of tests/verify_scripts/NAME.py that holds `words`."""
    lines = (HERE / f"{name}.py").read_text().splitlines()
    return f"{HERE / name}.py:{next(i for i, x in enumerate(lines, 1) if words in x)}"


def test_a_subset_training_set_is_clean_and_the_report_says_what_it_checked(verified):
    report, text = verified["good_subset"]
    assert report["status"] == 0 and report["findings"] == [], text
    data = next(c for c in report["checked"] if c.startswith("data-coverage"))
    assert "2 passes of loader 0" in data and "against the 64 samples of the Subset the loader wraps" in data
    assert line_of("good_subset", "for x, y in loader:") in data
    assert any(c.startswith("replica-divergence: 2 parameter tensors bitwise on 2 ranks after each of 4 steps")
               for c in report["checked"]), report["checked"]
    limits = " ".join(report["cannot_rule_out"])
    for words in ("augmentation", "per micro-batch", "mean of per-rank means", "pads"):
        assert words in limits
    assert "--resume" in limits and "checked:\n  - data-coverage" in text and "\ncannot rule out:\n" in text


def test_a_relaunch_without_the_scripts_resume_flag_is_a_finding(verified):
    report, text = verified["bad_resume_flag"]
    assert [(f["category"], f["rank"], f["step"]) for f in report["findings"]] == [("resume-mismatch", 0, 1)], text
    f = report["findings"][0]
    assert "did not resume" in f["message"] and "after `--`" in f["fix"]
    assert f["line"] == line_of("bad_resume_flag", "optimizer.step()")
    assert [(r.get("what"), r.get("from_step")) for r in report["runs"]] == [
        (None, None), ("killed at step 2", None), ("resumed", 1)]
    assert "resumed at step 1" in text and "cannot rule out" not in text


def test_the_scripts_own_resume_flag_after_the_double_dash_resumes(verified):
    report, text = verified["resume_flag_given"]
    assert report["status"] == 0 and report["findings"] == [], text
    assert [(r["steps"], r.get("from_step")) for r in report["runs"]] == [(3, None), (2, None), (2, 2)]
    assert any(c.startswith("resume-mismatch: killed after step 2 and relaunched; the relaunch's 2 steps, "
                            "from step 2, bitwise equal") for c in report["checked"]), report["checked"]
