"""Gradient accumulation under DDP, three ways, counted and timed (notebook 05).

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb05_nosync

Variants, same data and same initial weights:
  engineering    the engineering article's GradientAccumulator: DDP all-reduces after every micro-step
  survey         the survey article's accumulation loop: the same, written as a plain loop
  fixed          forward and backward inside no_sync() except on the last micro-step
  backward_only  the common misuse: forward outside no_sync(), only backward inside

Each rank records, per variant: bucket all-reduces and bytes (AllReduceCounter),
seconds per optimizer step, how far its parameters are from rank 0's, and how
far they are from the engineering variant's.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.lessons import data, models
from ddp_lab.engine import runtime
from ddp_lab.lessons.accumulation import (AllReduceCounter, ArticleGradientAccumulator, GradientAccumulator,
                                  survey_article_loop)

VARIANTS = ("engineering", "survey", "fixed", "backward_only")


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_window(variant, acc, model, batches):
    """One optimizer step's worth of micro-steps."""
    if variant == "survey":                     # the article's own loop over this window's batches
        survey_article_loop(model, acc.optimizer, acc.scaler, batches, acc.accumulation_steps)
        return
    for x, y in batches:
        if variant == "engineering":
            acc.step(F.cross_entropy(model(x), y))
        elif variant == "fixed":
            with acc.sync_context():            # forward AND backward inside
                acc.step(F.cross_entropy(model(x), y))
        else:                                   # backward_only: the misuse
            loss = F.cross_entropy(model(x), y)  # forward already told DDP to sync
            with acc.sync_context():
                acc.step(loss)


def run(ctx, args):
    # Models live in this function, so they are freed before the process group is destroyed
    X, Y = data.digits_tensors("train")
    X, Y = X[ctx.rank::ctx.world_size].to(ctx.device), Y[ctx.rank::ctx.world_size].to(ctx.device)  # this rank's shard
    K, b = args.accum_steps, args.micro_batch
    windows = [[(X[i:i + b], Y[i:i + b]) for i in range(w * K * b, (w + 1) * K * b, b)]
               for w in range(args.updates + 1)]  # window 0 warms up (DDP builds its buckets)
    reference = None
    for variant in VARIANTS:
        torch.manual_seed(0)
        model = DDP(getattr(models, args.model)().to(ctx.device))
        counter = AllReduceCounter(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", enabled=False)  # fp32 here; the API is the same with fp16
        acc = (GradientAccumulator if variant in ("fixed", "backward_only") else ArticleGradientAccumulator)(
            model, optimizer, scaler, accumulation_steps=K)
        run_window(variant, acc, model, windows[0])
        counter.reset()
        F.cross_entropy(model(X[:b]), Y[:b]).backward()  # one plain synced backward:
        buckets = counter.calls                           # how many buckets DDP all-reduces
        optimizer.zero_grad()
        counter.reset()
        dist.barrier()
        t0 = time.perf_counter()
        for window in windows[1:]:
            run_window(variant, acc, model, window)
        dist.barrier()
        seconds = (time.perf_counter() - t0) / args.updates
        mine = flat_params(model)
        rank0 = mine.clone()
        dist.broadcast(rank0, 0)
        if reference is None:
            reference = mine
        ctx.record(kind="variant", variant=variant, accum_steps=K, updates=args.updates,
                   micro_steps=args.updates * K, calls=counter.calls, bytes=counter.bytes,
                   buckets=buckets, seconds_per_update=seconds,
                   diff_to_rank0=(mine - rank0).abs().max().item(),
                   diff_to_engineering=(mine - reference).abs().max().item())
        ctx.print0(f"{variant:>13}: {counter.calls:3d} bucket all-reduces for {args.updates} updates "
                   f"({buckets} bucket{'s' * (buckets != 1)} per sync), {seconds * 1e3:6.0f} ms per update")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="wide_mlp", choices=["mlp", "cnn", "wide_mlp"])
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accum-steps", type=int, default=4)
    parser.add_argument("--updates", type=int, default=3, help="timed optimizer steps per variant")
    args = parser.parse_args(argv)
    with runtime.distributed() as ctx:
        run(ctx, args)


if __name__ == "__main__":
    main()
