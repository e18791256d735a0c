"""The script ladder (scripts/minimal_ddp.py ... scripts/train_ddp.py) stays a ladder.

Each rung is a small diff of the one before, changes exactly the functions it says it changes
(a fix made to train_ddp.py alone fails here until the rungs below it have it too), trains on two
ranks, and from rung 2 up trains exactly like the rung before it when its new features are off
(rung 2 trains on the digits, rung 1 on a small synthetic set of its own). The trainings share one
launch (ddp_lab/experiments/nb06b_ladder.py calls each rung's own train(), as notebook 06b does):
each rung file run on its own under torchrun, main() included, is tests/test_verify_ladder.py's
(every rung to the end on 2 ranks, under `ddp-lab verify`).
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from ddp_lab.engine import launch
from ddp_lab.lessons import ladder


def test_each_rung_is_a_small_diff_of_the_one_before():
    rows = ladder.table()
    assert [r["file"] for r in rows][0] == "minimal_ddp.py" and rows[-1]["file"] == "train_ddp.py"
    too_big = [(r["file"], r["changed"], r["bound"]) for r in rows[1:] if r["changed"] > r["bound"]]
    assert not too_big, f"more changed lines than the bound (file, changed, bound): {too_big}"
    assert [r["bound"] for r in rows[1:-1]] == [ladder.MAX_CHANGED] * (len(rows) - 2)
    # the ladder climbs: every rung is longer than the one before
    assert all(a["lines"] < b["lines"] for a, b in zip(rows, rows[1:]))


def test_each_rung_changes_exactly_what_it_declares():
    first = ladder.RUNGS[0]
    assert set(ladder.definitions(first)) == set(first.changes)
    for prev, rung in zip(ladder.RUNGS, ladder.RUNGS[1:]):
        got, declared = ladder.changed_definitions(prev, rung), set(rung.changes)
        assert got == declared, (f"{rung.file}: changes {sorted(got - declared)} without declaring them, "
                                 f"declares {sorted(declared - got)} without changing them; a fix "
                                 "belongs in every rung that has the function")


def test_every_script_but_the_benchmark_is_a_rung():
    rungs = {r.file for r in ladder.RUNGS}
    assert {p.name for p in ladder.SCRIPTS.glob("*.py")} - rungs == {"allreduce_bench.py"}


def test_changed_definitions_sees_a_one_line_fix(tmp_path, monkeypatch):
    # the declared-changes test is only as good as this: a changed line inside a function is seen
    a, b = ladder.path(ladder.RUNGS[-2]), tmp_path / "patched.py"
    b.write_text(a.read_text().replace("os.fsync(f.fileno())", "pass", 1))
    assert ladder.changed_definitions(a, b) == {"atomic_save"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every rung's train() on 2 ranks, one epoch each, its features off (from rung 4 up that means a
    constant learning rate: the cosine schedule is on by default), in one launch: (folder, the Run,
    rank 0's lines by rung)."""
    d = tmp_path_factory.mktemp("ladder")
    run = launch.torchrun("-m ddp_lab.experiments.nb06b_ladder", nproc=2, stream=False,
                          args=["--epochs", "1", "--out", str(d)])
    by_rung, k = {}, 0
    for line in run.rank_lines[0]:
        if line.startswith("--- rung "):
            k = int(line.split()[2].rstrip(":"))
        by_rung.setdefault(k, []).append(line)
    return d, run, by_rung


def records(path, kind):
    return [r for r in map(json.loads, Path(path).read_text().splitlines()) if r["kind"] == kind]


def test_every_rung_trains_on_two_ranks(launched):
    d, run, by_rung = launched
    assert run.returncode == 0 and sorted(k for k in by_rung if k) == list(range(1, len(ladder.RUNGS) + 1)), sorted(by_rung)
    assert any(line.startswith("epoch 0 loss") for line in by_rung[1])
    assert sorted(torch.load(d / "minimal_ddp.pt", weights_only=True)) == ["1.bias", "1.weight", "3.bias", "3.weight"]
    for k in range(2, len(ladder.RUNGS) + 1):
        (ev,) = records(d / f"rung{k}.jsonl", "eval")
        assert ev["count"] == 297 and ev["acc"] > 0.5, (k, ev)   # every validation digit, once
    assert not any(line.startswith("eval") for line in run.rank_lines.get(1, []))  # rank 0 prints


def test_a_rung_trains_exactly_like_the_one_before_when_its_features_are_off(launched):
    d, run, by_rung = launched
    ev = {k: records(d / f"rung{k}.jsonl", "eval")[0] for k in range(2, len(ladder.RUNGS) + 1)}
    # rung 3 adds checkpoints (off without --ckpt-dir), rung 4 precision, accumulation, clipping and
    # a schedule (fp32, 1, none, constant here); rungs 5-8 checks, data, models and tools: all off
    assert len({(ev[k]["loss"], ev[k]["acc"]) for k in range(2, len(ladder.RUNGS) + 1)}) == 1, ev
    # and weight for weight: the final weights' sha256, on both ranks, taken by the probe from the model
    # each rung wrapped in DDP; train_ddp.py's own record of it agrees
    sha = {(r["rung"], r["rank"]): r["params_sha256"] for r in run.select(kind="weights")}
    assert sorted(sha) == [(k, r) for k in range(1, len(ladder.RUNGS) + 1) for r in (0, 1)], sorted(sha)
    assert all(sha[k, 0] == sha[k, 1] for k in range(1, len(ladder.RUNGS) + 1)), sha
    assert len({sha[k, 0] for k in range(2, len(ladder.RUNGS) + 1)}) == 1, sha
    assert sha[1, 0] != sha[2, 0]  # rung 1 trains another model on another task: the fingerprint tells
    (final,) = records(d / f"rung{len(ladder.RUNGS)}.jsonl", "final")
    assert final["params_sha256"] == sha[len(ladder.RUNGS), 0]
    # rung 1 trains on its own synthetic two-class set: read its last epoch loss, better than chance
    (last,) = [line for line in by_rung[1] if line.startswith("epoch 0 loss")]
    assert float(last.split()[-1]) < math.log(2)


def run(script, *args, cwd):
    proc = subprocess.run([sys.executable, str(ladder.path(script)), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_rung3_stopped_and_resumed_equals_uninterrupted(tmp_path):
    run("ddp3_checkpoint.py", "--epochs", 2, "--ckpt-dir", "straight", cwd=tmp_path)
    run("ddp3_checkpoint.py", "--epochs", 2, "--ckpt-dir", "resumed", "--max-steps", 30, cwd=tmp_path)
    out = run("ddp3_checkpoint.py", "--epochs", 2, "--ckpt-dir", "resumed", cwd=tmp_path)
    assert "resumed from resumed/last.pt at step 30 (epoch 0, sample 960)" in out  # mid-epoch: 47 x 32 per epoch
    a = torch.load(tmp_path / "straight" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "last.pt", weights_only=True)
    assert a["step"] == b["step"] == 94
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_rung5_bad_flag_is_one_message_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, str(ladder.path("ddp5_errors.py")), "--batch-size", "0"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --batch-size must be at least 1 (got 0)"


@pytest.mark.parametrize("rung", ["ddp7_data_models.py", "ddp8_task.py"])
def test_own_data_float64_inputs_stop_with_one_line_naming_the_fix(tmp_path, rung):
    # rung 7 brings your own data: built without dtype=torch.float32, numpy's float64 reaches the model;
    # rung 8 reads the first sample through its Task and keeps the check
    source = ladder.path(rung).read_text()
    built = "X = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0"
    assert source.count(built) == 1
    (tmp_path / "own_data.py").write_text(source.replace(built, built.replace("float32", "float64")))
    proc = subprocess.run([sys.executable, "own_data.py", "--max-steps", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("error: the inputs are torch.float64, the model float32: build the dataset "
                                   "from torch.tensor(X, dtype=torch.float32)"), proc.stderr[-3000:]


def test_rung8_trains_a_regression_and_refuses_to_resume_it_as_a_classifier(tmp_path):
    # the task seam: --task regression swaps the targets, the loss and the metrics; the loops are unchanged
    data = ["--dataset", "synthetic", "--synthetic-shape", "16", "--synthetic-size", 256, "--epochs", 1]
    out = run("ddp8_task.py", *data, "--task", "regression", "--metrics-out", "m.jsonl", "--ckpt-dir", "ck",
              cwd=tmp_path)
    (ev,) = records(tmp_path / "m.jsonl", "eval")
    assert ev["count"] == 32 and "acc" not in ev and math.isclose(ev["rmse"], math.sqrt(ev["loss"]))
    assert "rmse" in out
    # the checkpoint records the task: resuming it as a classifier is one line naming both, exit code 2
    proc = subprocess.run([sys.executable, str(ladder.path("ddp8_task.py")), *map(str, data), "--ckpt-dir", "ck"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert "--task regression, this run has" in proc.stderr and "--task classification" in proc.stderr


def test_rung8_refuses_a_validation_set_smaller_than_the_world():
    # evaluate all-reduces each rank's sums: a rank with no validation sample would have none to send
    task = ladder.load(8).Task("classification", 10)
    x, y = torch.zeros(8, 4), torch.zeros(8, dtype=torch.long)
    splits = {"training": TensorDataset(x, y), "validation": TensorDataset(x[:1], y[:1])}
    assert task.check_data(splits, world_size=2).startswith("the validation set has 1 sample(s) for 2 ranks")
    assert task.check_data(splits, world_size=1) is None and task.shape == (4,)
