"""What a checkpoint must hold: leave one part out and the resumed run is no longer exact.

    from ddp_lab.lessons.checkpointing import parts as checkpoint_parts
    result = checkpoint_parts.leave_one_out()   # one process, about a second
    result["max_abs_diff"]                      # {"nothing": 0.0, "model": ..., "rng": ...}

A small digits model with everything a real run has: dropout (torch RNG), a random flip
(Python RNG), AdamW (moments), a cosine schedule, fp16 autocast with a GradScaler that
really skips overflowing steps, and a shuffling DistributedSampler (epoch + position).
It trains 20 steps straight, and again as 12 steps, a checkpoint (checkpointing.make_checkpoint),
a fresh "process" (other init, other RNG) and 8 more steps. The full checkpoint gives bitwise
the same weights; each part left out (checkpointing.restore(..., skip=...)) gives different ones.
`python -m ddp_lab.experiments.nb06_what_to_save` prints the same table.
"""
from __future__ import annotations

import io
import math
import random
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

from ddp_lab.lessons import checkpointing as ck
from ddp_lab.lessons import data

BATCH, TOTAL, SPLIT = 100, 20, 12  # 15 steps per epoch: the resumed part crosses an epoch
LEAVE_OUT = {"nothing": (), "model": ("model",), "optimizer": ("optimizer",),
             "scheduler": ("scheduler",), "scaler": ("scaler",), "epoch + step": ("epoch", "step"),
             "rng": ("rng",)}


def build(seed: int):
    torch.manual_seed(seed)
    random.seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / TOTAL))))
    # growth_interval=1: the scale doubles every good step, so fp16 overflows (and skipped
    # steps) happen within a few steps, as they do over hours in a real fp16 run.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
    return model, optimizer, scheduler, scaler


def train(parts, X, y, start: int, stop: int) -> list:
    """Steps start..stop-1; the position in the data follows from the step alone."""
    model, optimizer, scheduler, scaler = parts
    sampler = DistributedSampler(range(len(y)), num_replicas=1, rank=0, shuffle=True, seed=0)
    per_epoch = math.ceil(len(y) / BATCH)
    losses, step = [], start
    model.train()
    while step < stop:
        epoch, offset = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        order = list(sampler)[offset * BATCH:]  # skip what this epoch already used
        for i in range(0, len(order), BATCH):
            idx = order[i:i + BATCH]
            xb = X[idx].flip(-1) if random.random() < 0.5 else X[idx]  # Python RNG
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(xb), y[idx])
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skipped when the scaled gradients overflowed
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            losses.append(loss.item())
            step += 1
            if step == stop:
                break
    return losses


def leave_one_out() -> dict:
    """Train straight through, then resume from a checkpoint with each part of LEAVE_OUT left out.

    Returns {"size_bytes", "keys" (of the checkpoint), "max_abs_diff": {part: largest weight
    difference between the resumed and the straight run}}."""
    with warnings.catch_warnings():
        # A step the scaler skipped looks to the scheduler like "scheduler before optimizer": expected here.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        X, y = data.digits_tensors("train")
        straight = build(seed=0)
        train(straight, X, y, 0, TOTAL)
        first = build(seed=0)
        train(first, X, y, 0, SPLIT)
        buf = io.BytesIO()  # a real round trip through bytes, as through a file
        torch.save(ck.make_checkpoint(*first, epoch=SPLIT // 15, step=SPLIT, config={"batch": BATCH}), buf)
        out = {"size_bytes": buf.getbuffer().nbytes, "max_abs_diff": {}, "keys": None}
        for name, skip in LEAVE_OUT.items():
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=True)
            out["keys"] = sorted(ckpt)
            resumed = build(seed=1)  # a new process: other initial weights, other RNG state
            pos = ck.restore(ckpt, *resumed, skip=skip)
            train(resumed, X, y, pos["step"], pos["step"] + TOTAL - SPLIT)
            diff = max((a - b).abs().max().item() for a, b in
                       zip(straight[0].state_dict().values(), resumed[0].state_dict().values()))
            out["max_abs_diff"][name] = diff
    return out
