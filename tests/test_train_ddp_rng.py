"""Each rank its own random stream (dropout, augmentation), and still a bitwise-exact resume."""
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ddp_lab.engine import launch

# 12 steps per epoch (1500 digits / 2 ranks / 64): saves at 7 and 14, the crash after 15, mid-epoch 1.
DROPOUT = ["--batch-size", "64", "--max-steps", "20", "--log-every", "5", "--dropout", "0.3",
           "--progress", "off"]


def final(path):
    recs = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [r for r in recs if r["kind"] == "final"]


def test_ranks_draw_different_dropout_masks_and_a_crash_resumes_bitwise(tmp_path):
    launch.torchrun("train_ddp.py", nproc=2, stream=False, timeout=400, args=[
        *DROPOUT, "--ckpt-dir", tmp_path / "ref", "--metrics-out", tmp_path / "ref.jsonl"])
    rng = torch.load(tmp_path / "ref" / "last.pt", weights_only=True)["rng"]
    assert len(rng) == 2  # one random state per rank
    masks = []
    for state in rng:  # the next dropout mask each rank would draw
        torch.set_rng_state(state["torch"])
        masks.append(F.dropout(torch.ones(4096), p=0.5) != 0)
    assert not torch.equal(masks[0], masks[1])

    run = launch.torchrun("train_ddp.py", nproc=2, max_restarts=1, stream=False, timeout=400, args=[
        *DROPOUT, "--ckpt-dir", tmp_path / "crash", "--save-every", "7", "--crash-at-step", "15",
        "--metrics-out", tmp_path / "crash.jsonl"])
    assert "crash-at-step 15" in run.log
    crashed, ref = final(tmp_path / "crash.jsonl"), final(tmp_path / "ref.jsonl")
    assert len(crashed) == 1 and crashed[0]["step"] == 20
    # every rank's dropout stream was restored: otherwise steps 15-20 would draw other masks
    assert crashed[0]["params_sha256"] == ref[0]["params_sha256"]
