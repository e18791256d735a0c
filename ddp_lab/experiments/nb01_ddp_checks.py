"""Notebook 01's probe: what DDP guarantees, and what it costs on this machine.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb01_ddp_checks

One launch records four things (run.select(kind=...)):
  per_rank_seed  the survey article's seed_everything(42 + rank): parameter checksums
          before and after DDP(...) wraps the model, and one random draw per rank
  grad    DDP's averaged gradient after one step on this rank's half of a batch
  bn      BatchNorm running mean across ranks with broadcast_buffers False/True
          (and SyncBatchNorm when CUDA is there)
  timing  per model: DDP step, compute alone (no_sync) and one all-reduce of all gradients,
          and the bytes DDP's comm hook handed to all-reduce in one step with and without no_sync
"""
from __future__ import annotations

import argparse
import contextlib
import random
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_lab.lessons import buckets, models
from ddp_lab.engine import runtime
from ddp_lab.lessons.data import digits, digits_tensors

GRAD_BATCH = 64   # global batch of the gradient check; each rank takes half
BN_STEPS = 30
BN_BATCH = 8    # per rank: small per-device batches make BatchNorm statistics noisy
TIMING = {"cnn": (models.cnn, 128), "wide_mlp": (models.wide_mlp, 16)}  # model, global batch
TIMING_STEPS = 6


def seed_everything(seed: int) -> None:
    """The survey article's seed_everything, unchanged."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def seed_and_grad(ctx) -> None:
    seed_everything(42 + ctx.rank)  # the survey article, on purpose  # ddp-lab: ignore[DDP006]
    model = models.mlp().to(ctx.device)
    before = checksum(model)                  # differs per rank: different seeds
    model = DDP(model)                        # DDP broadcasts rank 0's parameters here
    ctx.record(kind="per_rank_seed", before=before, after=checksum(model.module),
               draw=torch.rand(3).tolist())   # per-rank randomness (dropout, augmentation) stays different
    X, y = digits_tensors("train")
    half = GRAD_BATCH // ctx.world_size
    x = X[ctx.rank * half:(ctx.rank + 1) * half].to(ctx.device)
    t = y[ctx.rank * half:(ctx.rank + 1) * half].to(ctx.device)
    F.cross_entropy(model(x), t).backward()   # gradients are averaged across ranks during backward
    ctx.record(kind="grad", grad=flat_grad(model.module).cpu().tolist())


def bn_drift(ctx, mode: str) -> None:
    """Train a BatchNorm CNN for a few steps; gather the first BN layer's running mean
    as each forward starts (after DDP's own buffer broadcast, if any)."""
    torch.manual_seed(0)
    net = models.cnn(batch_norm=True, channels=8)
    if mode == "sync_bn":
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = net.to(ctx.device)
    with warnings.catch_warnings():  # called forward_sync_buffers since torch 2.13; the article uses the old name
        warnings.simplefilter("ignore", FutureWarning)
        model = DDP(net, broadcast_buffers=(mode != "no_broadcast"))   # the survey article passes False
    seen = {}
    model.module[1].register_forward_pre_hook(lambda m, i: seen.update(mean=m.running_mean.clone()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = digits("train")
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BN_BATCH, sampler=sampler)
    gaps = []
    for step, (x, t) in zip(range(BN_STEPS), loader):
        loss = F.cross_entropy(model(x.to(ctx.device)), t.to(ctx.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        gathered = [torch.empty_like(seen["mean"]) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, seen["mean"])
        gaps.append(max((g - gathered[0]).abs().max().item() for g in gathered))
    X, y = digits_tensors("val")
    model.module.eval()                        # eval uses this rank's own running statistics
    with torch.no_grad():
        logits = model.module(X.to(ctx.device))
    everyone = [torch.empty_like(logits) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, logits)
    ctx.record(kind="bn", mode=mode, gaps=gaps,
               val_accuracy=(logits.argmax(1).cpu() == y).float().mean().item(),
               logits_gap=max((e - everyone[0]).abs().max().item() for e in everyone),
               running_mean=model.module[1].running_mean.cpu().tolist())


def timed_steps(model, optimizer, x, y, steps: int, sync: bool = True, together: bool = True) -> float:
    """Median seconds per training step; sync=False skips the gradient all-reduce (DDP.no_sync)."""
    def one():
        with (contextlib.nullcontext() if sync or not isinstance(model, DDP) else model.no_sync()):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()

    one()  # warm-up: first-call allocations, DDP bucket rebuild
    if together and dist.is_initialized():
        dist.barrier()  # start together, so one rank's warm-up does not count as the other's wait
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]  # the median: robust to a busy neighbour's spikes


def batch_for(name: str, batch: int, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return (torch.rand(batch, 1, 8, 8, generator=g).to(device),
            torch.randint(0, 10, (batch,), generator=g).to(device))


def single_process_step_s(name: str, threads: int, steps: int = TIMING_STEPS) -> float:
    """The baseline: one process, no DDP, the whole global batch on `threads` cores."""
    make, global_batch = TIMING[name]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = make()
        x, y = batch_for(name, global_batch)
        return timed_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), x, y, steps, together=False)
    finally:
        torch.set_num_threads(before)


def timing(ctx) -> None:
    for name, (make, global_batch) in TIMING.items():
        if ctx.is_main:  # baseline while the other ranks wait idle at the barrier
            ctx.record(kind="baseline", model=name, one_core_s=single_process_step_s(name, 1),
                       all_cores_s=single_process_step_s(name, ctx.local_world_size))
        dist.barrier()
        torch.manual_seed(0)
        model = DDP(make().to(ctx.device))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = batch_for(name, global_batch // ctx.world_size, ctx.device)
        step_s = timed_steps(model, optimizer, x, y, TIMING_STEPS, sync=True)
        compute_s = timed_steps(model, optimizer, x, y, TIMING_STEPS, sync=False)
        flat = torch.zeros(models.n_params(model.module), device=ctx.device)
        dist.all_reduce(flat)  # warm-up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            times.append(time.perf_counter() - t0)
        allreduce_s = sorted(times)[1]
        ctx.record(kind="timing", model=name, params=models.n_params(model.module),
                   grad_bytes=flat.nbytes, global_batch=global_batch, step_s=step_s,
                   compute_s=compute_s, allreduce_s=allreduce_s, threads=torch.get_num_threads(),
                   hook_bytes=bytes_per_step(make, x, y, ctx.device))
        del model, optimizer


def bytes_per_step(make, x, y, device) -> dict:
    """Bytes DDP's buckets hand to all-reduce in one step, with sync and under no_sync()."""
    torch.manual_seed(0)
    model = DDP(make().to(device))
    log = []
    model.register_comm_hook(None, buckets.recording_hook(log))  # counts each bucket, then all-reduces it
    out = {}
    for mode in ("sync", "no_sync"):
        log.clear()
        with (model.no_sync() if mode == "no_sync" else contextlib.nullcontext()):
            F.cross_entropy(model(x), y).backward()
        out[mode] = sum(b["bytes"] for b in log)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()  # a synced step after no_sync, so no gradient is left pending
    del model
    return out


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    with runtime.distributed() as ctx:
        seed_and_grad(ctx)
        modes = ["no_broadcast", "broadcast"] + (["sync_bn"] if ctx.device.type == "cuda" else [])
        for mode in modes:
            bn_drift(ctx, mode)
        timing(ctx)
        ctx.print0("nb01 checks done")


if __name__ == "__main__":
    main()
