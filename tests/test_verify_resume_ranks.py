"""ddp-lab verify --resume compares every rank with its own uninterrupted run: a checkpoint that
restores rank 0 exactly but gives rank 1 rank 0's random state is found, naming rank 1; its twin,
where each rank saves and loads its own random state, is clean on both ranks.
Two verifies of 3 launches each (2 ranks, tiny data, gloo), two at a time, shared below."""
import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "verify_scripts"
RUNS = ("bad_resume_rank_rng", "good_resume_rank_rng")


def _verify(name):
    from ddp_lab.verify import command
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = ["--steps", "3", "--resume", "--timeout", "120", "--json", "--", str(HERE / f"{name}.py")]
    return json.loads(json.dumps(command.report_for(parser.parse_args(args)).to_dict()))


@pytest.fixture(scope="module")
def verified():
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(RUNS, pool.map(_verify, RUNS)))


def test_a_random_state_restored_from_rank_0_on_every_rank_is_found_on_rank_1(verified):
    report = verified["bad_resume_rank_rng"]
    assert [(r["steps"], r.get("what")) for r in report["runs"]] == [
        (3, None), (2, "killed at step 2"), (2, "resumed")], report["runs"]
    assert [(f["category"], f["rank"], f["step"]) for f in report["findings"]] == [("resume-mismatch", 1, 2)], report
    f = report["findings"][0]
    assert "what was not restored is rank 1's" in f["message"]
    assert "on rank 1: the random state before the step (torch's global generator)" in f["evidence"]
    assert "on rank 0" not in f["evidence"]  # rank 0's own state came back exactly
    assert "restores rank 0's stream only" in f["fix"]


def test_each_rank_restoring_its_own_random_state_resumes_exactly_on_every_rank(verified):
    report = verified["good_resume_rank_rng"]
    assert report["status"] == 0 and report["findings"] == [], report
    assert any(c.startswith("resume-mismatch: killed after step 2 and relaunched") and "on each of 2 ranks" in c
               for c in report["checked"]), report["checked"]
