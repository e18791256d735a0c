"""The optimizer step of rungs 4-8: clipping, the non-finite guard, the real batch, BatchNorm at evaluation.

optimizer_step is the same function in every rung from ddp4_amp_accum.py up (tests/test_ladder.py
keeps it so); the launched tests watch train_ddp.py from outside through tests/programs/step_probe.py.
"""
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PROGRAMS
from ddp_lab.engine import launch
from ddp_lab.lessons import ladder


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_ddp_steps", ladder.path("train_ddp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_with_grads(grads):
    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.tensor([grads])
    return model


def test_clipping_reports_the_norm_before_clipping_and_clips_to_max(script):
    model = model_with_grads([3.0, 4.0])  # norm 5
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    norm, skipped = script.optimizer_step(opt, torch.amp.GradScaler("cpu", enabled=False), model.parameters(), 1.0)
    assert norm.item() == pytest.approx(5.0) and not skipped
    # SGD with lr 1 moved the weights by the clipped gradient: norm 1, direction (3, 4)
    assert torch.allclose(before - model.weight.detach(), torch.tensor([[0.6, 0.8]]))


def test_without_clipping_the_gradients_are_untouched_bit_for_bit(script):
    model = model_with_grads([0.1, 1e-30])
    grad = model.weight.grad.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    norm, _ = script.optimizer_step(opt, torch.amp.GradScaler("cpu", enabled=False), model.parameters(), None)
    assert torch.equal(model.weight.grad, grad)
    assert norm.item() == pytest.approx(math.hypot(0.1, 1e-30))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_skips_the_step(script, bad):
    model = model_with_grads([1.0, bad])
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norm, skipped = script.optimizer_step(opt, torch.amp.GradScaler("cpu", enabled=False), model.parameters(), 1.0)
    assert skipped and not math.isfinite(norm.item())
    assert torch.equal(model.weight.detach(), before) and not opt.state  # no step, no momentum


def test_fp16_scaler_skips_once_and_clips_unscaled_gradients(script):
    model = torch.nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale((model.weight * torch.tensor([3.0, 4.0])).sum()).backward()  # gradients 1024 x (3, 4)
    norm, skipped = script.optimizer_step(opt, scaler, model.parameters(), 1.0)
    assert norm.item() == pytest.approx(5.0) and not skipped  # the true norm, not 1024 x it
    opt.zero_grad()
    scaler.scale((model.weight * torch.tensor([float("inf"), 1.0])).sum()).backward()
    before = model.weight.detach().clone()
    norm, skipped = script.optimizer_step(opt, scaler, model.parameters(), 1.0)
    assert skipped and torch.equal(model.weight.detach(), before)
    assert scaler.get_scale() == 512.0  # backed off once: the scaler's skip, not a second one of ours


def probe(tmp_path, *args, env=None):
    """train_ddp.py under torchrun (2 ranks) through the step probe: (train records, eval records, probes)."""
    out = tmp_path / "m.jsonl"
    run = launch.torchrun(PROGRAMS / "step_probe.py", nproc=2, stream=False, env=env or {},
                          args=["train_ddp.py", "--metrics-out", out, *args])
    probes = sorted((json.loads(line[6:]) for lines in run.rank_lines.values() for line in lines
                     if line.startswith("PROBE ")), key=lambda p: p["rank"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [p["rank"] for p in probes] == [0, 1]
    return run, [r for r in records if r["kind"] == "train"], [r for r in records if r["kind"] == "eval"], probes


def test_a_nan_on_one_rank_skips_that_step_on_every_rank(tmp_path):
    # rank 1's loss is NaN during step 5; accumulation 2, so clipping must still run once per step
    run, train, evals, probes = probe(tmp_path, "--epochs", 1, "--max-steps", 8, "--accum-steps", 2,
                                      "--log-every", 4, "--clip-grad-norm", 1.0, env={"NAN_STEP": "5"})
    assert [p["skipped"] for p in probes] == [[5], [5]]
    assert [(p["steps"], p["clips"]) for p in probes] == [(8, 8), (8, 8)]
    assert probes[0]["final_sha"] == probes[1]["final_sha"]  # the replicas are still equal
    assert [(r["step"], r["skipped"]) for r in train] == [(4, False), (5, True), (8, False)]
    assert all(math.isfinite(r["grad_norm"]) for r in train if not r["skipped"])
    assert math.isfinite(evals[-1]["loss"]) and evals[-1]["step"] == 8
    assert any("(skipped: non-finite gradients)" in line for line in run.rank_lines[0])


def test_batch_norm_ranks_evaluate_the_same_model(tmp_path):
    # each rank's last training forward updates its own running statistics; evaluation must not see that
    _, _, evals, probes = probe(tmp_path, "--model", "cnn", "--batch-norm", "--epochs", 2, "--max-steps", 30)
    assert len(evals) == 2 and [len(p["eval_sha"]) for p in probes] == [2, 2]
    assert probes[0]["eval_sha"] == probes[1]["eval_sha"]


def test_a_batch_larger_than_a_ranks_share_uses_the_share(tmp_path):
    out = tmp_path / "m.jsonl"
    run = launch.torchrun("train_ddp.py", nproc=2, stream=False, args=[
        "--dataset", "synthetic", "--synthetic-size", 142, "--synthetic-shape", "1,4,4", "--epochs", 1,
        "--batch-size", 500, "--lr-scaling", "linear", "--metrics-out", out])
    (config,) = [r for r in map(json.loads, out.read_text().splitlines()) if r["kind"] == "config"]
    assert config["batch_size"] == 71 and config["effective_batch"] == 142 and config["steps_per_epoch"] == 1
    assert config["lr_effective"] == pytest.approx(0.05 * 2)  # linear: x world size, from the real batch
    warnings = [line for lines in run.rank_lines.values() for line in lines if line.startswith("warning: --batch-size")]
    assert warnings == ["warning: --batch-size 500 is more than a rank's share of the data (142 samples / "
                        "2 ranks): each rank trains batches of 71, and this run uses --batch-size 71"]
    assert any("effective batch=71 x 2 ranks x 1 accum = 142" in line for line in run.rank_lines[0])


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_clip_grad_norm_must_be_positive(tmp_path, value):
    proc = subprocess.run([sys.executable, ladder.path("train_ddp.py"), "--clip-grad-norm", value],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: --clip-grad-norm must be positive (got {float(value)})"
