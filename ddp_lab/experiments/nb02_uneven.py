"""Uneven batches per rank: the hang, and the fix with torch.distributed.algorithms.Join.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb02_uneven --fix none
    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb02_uneven --fix join

Each rank reads its own shard "file", and the files are uneven: rank r has
96 + 32 r samples, so with batches of 32 rank 0 runs 3 steps and rank 1 runs 4.
With --fix none, rank 0 finishes and waits at the barrier before saving while
rank 1 waits for a 4th gradient all-reduce that nobody joins: both wait until
the collective timeout (DDP_LAB_TIMEOUT). With --fix join, Join lets the rank
that ran out of data shadow the others' all-reduces until everyone is done.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab import models, runtime
from ddp_lab.data import digits_tensors

BATCH = 32

parser = argparse.ArgumentParser()
parser.add_argument("--fix", choices=["none", "join"], default="none")
args = parser.parse_args()

with runtime.distributed() as ctx:
    torch.manual_seed(0)
    model = DDP(models.mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = digits_tensors("train")
    start = sum(96 + 32 * r for r in range(ctx.rank))
    shard = range(start, start + 96 + 32 * ctx.rank)          # uneven on purpose
    batches = [list(shard[i:i + BATCH]) for i in range(0, len(shard), BATCH)]
    # NEW: Join takes the joinable objects (the DDP model) and keeps the
    # collectives matched after this rank's loop ends.
    join = Join([model]) if args.fix == "join" else __import__("contextlib").nullcontext()
    loss_sum, count = 0.0, 0
    with join:
        for step, b in enumerate(batches):
            loss = F.cross_entropy(model(X[b]), y[b])
            optimizer.zero_grad()
            loss.backward()          # all-reduce: every rank must be here
            optimizer.step()
            loss_sum, count = loss_sum + loss.item() * len(b), count + len(b)
            print(f"step {step} done ({len(b)} samples)", flush=True)
    print(f"finished my {len(batches)} batches; waiting for the others", flush=True)
    dist.barrier()                   # e.g. before rank 0 saves a checkpoint
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    ctx.record(kind="done", steps=len(batches), samples=count, checksum=checksum,
               loss=runtime.all_reduce_mean([loss_sum, count]))
    ctx.print0("all ranks finished")
