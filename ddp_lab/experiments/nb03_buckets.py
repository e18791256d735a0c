"""Buckets, overlap, compression and stragglers, measured in one launch.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb03_buckets

1. Same model, same data, three ways: naive all-reduce after backward, hand-written
   buckets fired by gradient hooks, real DDP. Final weights compared, step times kept.
2. DDP's buckets as its comm hook sees them (index, bytes, start/end times), for the
   default and for several bucket_cap_mb values.
3. fp16/bf16 gradient compression hooks: bytes handed to all_reduce, and accuracy.
4. A straggler: one rank sleeps before the all-reduce; everyone's wait is recorded.
"""
import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.lessons import buckets, models
from ddp_lab.engine import runtime
from ddp_lab.lessons.data import digits_tensors


def batches(rank, n, batch, seed=0):
    """This rank's own fixed inputs (different per rank, like a sharded loader)."""
    g = torch.Generator().manual_seed(seed + rank)
    return [(torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(n)]


def train(model, data, sync=None):
    """SGD steps; `sync(model)` runs after backward (hand-written DP).
    Returns, per step, when it started, backward started and ended, and the sync ended."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    marks = []
    for x, y in data:
        dist.barrier()  # start every step together so times compare
        m = {"t0": time.perf_counter()}
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        m["bwd_start"] = time.perf_counter()
        loss.backward()  # under DDP this returns once every bucket's all-reduce is done
        m["bwd_end"] = time.perf_counter()
        if sync:
            sync(model)
        m["sync_end"] = time.perf_counter()
        optimizer.step()
        m["t1"] = time.perf_counter()
        marks.append(m)
    return marks


def median_step(marks):
    # Step 0 includes one-off costs (DDP's first iteration, allocations): leave it out.
    return statistics.median(m["t1"] - m["t0"] for m in marks[1:])


def compare_implementations(ctx, base, data) -> None:
    """1. Three data-parallel implementations from the same start."""
    naive = copy.deepcopy(base)
    t_naive = train(naive, data, sync=buckets.all_reduce_grads)
    hand = copy.deepcopy(base)
    dp = buckets.BucketedDP(hand, bucket_cap_mb=25, first_bucket_mb=1)
    t_hand = train(hand, data, sync=lambda m: dp.finish())
    ddp = DDP(copy.deepcopy(base))
    t_ddp = train(ddp, data)
    ref = dict(naive.named_parameters())
    diff = lambda m: max((q - ref[k]).abs().max().item() for k, q in m.named_parameters())
    ctx.record(kind="equal", hand_vs_naive=diff(hand), ddp_vs_naive=diff(ddp.module),
               hand_buckets=[len(b) for b in dp.buckets])
    for name, marks in (("naive: all-reduce each tensor after backward", t_naive),
                        ("hand-written buckets + hooks", t_hand), ("DDP", t_ddp)):
        ctx.record(kind="step_time", variant=name, median_s=median_step(marks), marks=marks)


def bucket_timelines(ctx, base, data, caps) -> None:
    """2. DDP's buckets as the comm hook sees them; timeline of one step."""
    for cap in [None] + caps:
        log = []
        model = DDP(copy.deepcopy(base), bucket_cap_mb=cap)
        model.register_comm_hook(None, buckets.recording_hook(log))
        marks = train(model, data)
        ctx.record(kind="cap", cap=cap, median_s=median_step(marks), marks=marks)
        # DDP launches buckets in index order, so each bucket 0 starts a new step.
        it = -1
        for rec in log:
            it += rec["index"] == 0
            ctx.record(kind="bucket", cap=cap, iteration=it, **rec)
        del model


def compression(ctx, epochs: int) -> None:
    """3. Gradient compression: the same short training run, three comm hooks."""
    X, y = digits_tensors("train")
    Xv, yv = digits_tensors("val")
    shard = slice(ctx.rank, None, ctx.world_size)
    X, y = X[shard], y[shard]
    flat_weights = lambda m: torch.cat([q.detach().reshape(-1) for q in m.parameters()])
    fp32_weights = None
    for name, hook in (("fp32 (default)", default_hooks.allreduce_hook),
                       ("fp16 compress", default_hooks.fp16_compress_hook),
                       ("bf16 compress", default_hooks.bf16_compress_hook)):
        torch.manual_seed(0)
        model = DDP(models.mlp(hidden=128))
        model.register_comm_hook(None, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        steps = 0
        with buckets.CountingAllReduce() as count:
            for epoch in range(epochs):
                g = torch.Generator().manual_seed(epoch)
                for idx in torch.randperm(len(y), generator=g).split(32):
                    optimizer.zero_grad(set_to_none=True)
                    F.cross_entropy(model(X[idx]), y[idx]).backward()
                    optimizer.step()
                    steps += 1
        with torch.no_grad():
            out = model.module(Xv)
            acc = (out.argmax(1) == yv).float().mean().item()
            val_loss = F.cross_entropy(out, yv).item()
        if fp32_weights is None:  # the first run is the uncompressed reference
            fp32_weights = flat_weights(model)
        ctx.record(kind="compress", hook=name, bytes_per_step=count.bytes / steps, calls=count.calls,
                   steps=steps, val_acc=acc, val_loss=val_loss,
                   max_weight_diff=(flat_weights(model) - fp32_weights).abs().max().item())


def straggler(ctx, delays) -> None:
    """4. Straggler: rank 1 is slow; time each rank spends inside the all-reduce."""
    grad = torch.randn(256 * 1024)  # 1 MB of "gradient"
    w = torch.randn(256, 256)
    for delay in delays:
        for step in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(20):
                w @ w  # the same compute on every rank
            if ctx.rank == 1:
                time.sleep(delay)  # NEW: the straggler (a slower GPU, a noisy neighbour, more data)
            t1 = time.perf_counter()
            dist.all_reduce(grad)
            t2 = time.perf_counter()
            ctx.record(kind="straggler", delay=delay, step=step, compute_s=t1 - t0, wait_s=t2 - t1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)             # timed steps per variant (+1 warm-up)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--caps", default="1,5,25,100")              # bucket_cap_mb sweep
    p.add_argument("--epochs", type=int, default=2)             # compression run
    p.add_argument("--delays", default="0,0.05,0.1")            # straggler sleep, seconds
    args = p.parse_args(argv)
    # A CPU lesson: gloo and CPU tensors even on a GPU machine (one GPU cannot host two NCCL
    # ranks, and the measurements compare with the CPU numbers elsewhere in the notebook).
    os.environ.setdefault(runtime.BACKEND_ENV, "gloo")
    with runtime.distributed() as ctx:
        # Every DDP model lives in one section's function: freed before the group is destroyed.
        torch.manual_seed(0)
        base = buckets.deep_mlp()
        data = batches(ctx.rank, args.steps + 1, args.batch)
        ctx.record(kind="model", n_params=models.n_params(base),
                   tensor_bytes=[q.numel() * q.element_size() for q in base.parameters()])
        compare_implementations(ctx, base, data)
        bucket_timelines(ctx, base, data, [float(c) for c in args.caps.split(",")])
        compression(ctx, args.epochs)
        straggler(ctx, [float(d) for d in args.delays.split(",")])
        ctx.print0("buckets, compression and straggler measurements done")


if __name__ == "__main__":
    main()
