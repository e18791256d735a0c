"""Uneven batches per rank: the hang, and the fix with torch.distributed.algorithms.Join.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb02_uneven --fix none
    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb02_uneven --fix join

Each rank reads its own shard "file", and the files are uneven: rank r has
96 + 32 r samples, so with batches of 32 rank 0 runs 3 steps and rank 1 runs 4.
With --fix none, rank 0 finishes and waits at the barrier before saving while
rank 1 waits for a 4th gradient all-reduce that nobody joins: both wait until
the collective timeout (DDP_LAB_TIMEOUT). With --fix join, Join lets the rank
that ran out of data shadow the others' all-reduces (with zeros) until everyone
is done. It trains twice from the same start, once per way Join can divide:

  divide_by_initial_world_size=True   (the default) the tail step's sum is divided
                                      by the full world size, 2, though one rank sent zeros
  divide_by_initial_world_size=False  divided by the ranks still training

Records (run.select(kind=...)): "grad" per rank, variant and step, the gradient this
rank computed alone on its batch ("local") and the one DDP left in .grad ("applied");
"done" per rank and variant, with step and sample counts and a weights checksum.
"""
import argparse
import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.lessons import models
from ddp_lab.engine import runtime
from ddp_lab.lessons.data import digits_tensors

BATCH = 32
VARIANTS = {"divide_by_initial_world_size=True (default)": {},
            "divide_by_initial_world_size=False": {"divide_by_initial_world_size": False}}


def flat_grad(module) -> list:
    return torch.cat([p.grad.flatten() for p in module.parameters()]).tolist()


def train(ctx, variant: str | None) -> None:
    torch.manual_seed(0)
    model = DDP(models.mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = digits_tensors("train")
    start = sum(96 + 32 * r for r in range(ctx.rank))
    shard = range(start, start + 96 + 32 * ctx.rank)          # uneven on purpose
    batches = [list(shard[i:i + BATCH]) for i in range(0, len(shard), BATCH)]
    # NEW: Join takes the joinable objects (the DDP model) and keeps the
    # collectives matched after this rank's loop ends.
    join = Join([model], **VARIANTS[variant]) if variant else contextlib.nullcontext()
    loss_sum, count = 0.0, 0
    with join:
        for step, b in enumerate(batches):
            if variant:  # this rank's own gradient, from a plain copy with the same weights
                alone = copy.deepcopy(model.module)
                F.cross_entropy(alone(X[b]), y[b]).backward()
            loss = F.cross_entropy(model(X[b]), y[b])
            optimizer.zero_grad()
            loss.backward()          # all-reduce: every rank must be here
            if variant:
                ctx.record(kind="grad", variant=variant, step=step, local=flat_grad(alone),
                           applied=flat_grad(model.module))
            optimizer.step()
            loss_sum, count = loss_sum + loss.item() * len(b), count + len(b)
            print(f"step {step} done ({len(b)} samples)", flush=True)
    print(f"finished my {len(batches)} batches; waiting for the others", flush=True)
    dist.barrier()                   # e.g. before rank 0 saves a checkpoint
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    ctx.record(kind="done", variant=variant, steps=len(batches), samples=count, checksum=checksum,
               loss=runtime.all_reduce_mean([loss_sum, count]))
    del model, optimizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fix", choices=["none", "join"], default="none")
    args = parser.parse_args(argv)
    with runtime.distributed() as ctx:
        for variant in (VARIANTS if args.fix == "join" else [None]):
            train(ctx, variant)
        ctx.print0("all ranks finished")


if __name__ == "__main__":
    main()
