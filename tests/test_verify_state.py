"""ddp-lab verify on what differs across ranks outside the replicas: an EMA of the weights updated on
rank 0 alone, and noise drawn in the training loop from one seed on every rank, each found at the
script's own lines; their correct twins are clean, and the report says what was observed.
Four verifies (2-rank launches, tiny data, gloo), two at a time, shared below."""
import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "verify_scripts"
RUNS = {name: ["--steps", "3"] for name in ("bad_rank0_ema", "good_ema", "bad_loop_noise", "good_loop_noise")}


def _verify(name):
    from ddp_lab.verify import command
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    report = command.report_for(parser.parse_args([*RUNS[name], "--timeout", "120", "--json", "--",
                                                   str(HERE / f"{name}.py")]))
    return json.loads(json.dumps(report.to_dict()))


@pytest.fixture(scope="module")
def verified():
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(RUNS, pool.map(_verify, RUNS)))


def line_of(name, words):
    lines = (HERE / f"{name}.py").read_text().splitlines()
    return next(i for i, x in enumerate(lines, 1) if words in x)


def test_an_ema_updated_on_rank_0_alone_is_found_at_its_lines(verified):
    report = verified["bad_rank0_ema"]
    assert [(f["category"], f["rank"], f["step"]) for f in report["findings"]] == [("rank-state", 1, 2)], report
    f = report["findings"][0]
    assert "`ema` (Sequential) differs from rank 0" in f["message"]
    assert f["line"] == f"{HERE / 'bad_rank0_ema.py'}:{line_of('bad_rank0_ema', 'for e, p in zip')}"
    assert f"bad_rank0_ema.py:{line_of('bad_rank0_ema', 'if rank == 0:')} `if rank == 0:`" in f["fix"]
    assert "equal on every rank after step 1, then not" in f["evidence"]


def test_an_ema_updated_on_every_rank_is_clean_and_reported_as_hashed(verified):
    report = verified["good_ema"]
    assert report["status"] == 0 and report["findings"] == [], report
    assert "rank-state: 1 object kept outside the optimizer (ema (Sequential)) hashed on every rank after " \
           "each of 3 steps" in report["checked"], report["checked"]


def test_noise_drawn_in_the_loop_from_one_seed_is_found_at_the_draw(verified):
    report = verified["bad_loop_noise"]
    assert [(f["category"], f["rank"], f["step"]) for f in report["findings"]] == [("same-noise", None, 2)], report
    f = report["findings"][0]
    assert f["message"].startswith("every rank drew the same noise: torch's global generator")
    assert f["line"] == f"{HERE / 'bad_loop_noise.py'}:{line_of('bad_loop_noise', 'torch.randn_like(x)')}"
    assert "seed with seed + rank" in f["fix"]


def test_noise_drawn_in_the_loop_per_rank_is_clean_and_reported_as_observed(verified):
    report = verified["good_loop_noise"]
    assert report["status"] == 0 and report["findings"] == [], report
    checked = " ".join(report["checked"])
    assert "same-noise: observed, the training loop (between steps) drew from the global generators in 2 of 2 " in checked
    assert "same-noise: not observed: loading 2 training batches (augmentation" in checked
    quiet = " ".join(verified["good_ema"]["checked"])  # draws nothing in its loop
    assert "same-noise: not observed: the training loop (between steps) drew nothing" in quiet
    assert "rank-state: not observed" in checked  # no module besides the DDP model, nothing named ema
