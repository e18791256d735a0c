"""Notebook 09, section 6: the PyTorch side of the survey's TensorFlow/Horovod code, run.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb09_pairs

broadcast_parameters   models built with a different seed per rank; DDP(model) makes them equal
                       (Horovod: hvd.broadcast_parameters / BroadcastGlobalVariablesCallback)
optimizer_state        rank 0 resumes Adam from a checkpoint, the others do not: DDP leaves the
                       states different; broadcast_object_list makes them equal
                       (Horovod: hvd.broadcast_optimizer_state; DDP has no such call)
average_loss           per-rank sums of per-example losses, all-reduced and divided by the global
                       batch, against the mean over the whole batch in one process
                       (TF: strategy.run + strategy.reduce(SUM) + tf.nn.compute_average_loss)
Records kind="pair", one per name.
"""
import argparse
import os
import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.engine import runtime
from ddp_lab.lessons.beyond import Group


def digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def optim_digest(optimizer) -> str:
    return digest(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def run_all(grp):
    """Every pair on the ranks of grp (a ddp_lab.lessons.beyond.Group: a job of its own inside a launch)."""
    torch.manual_seed(grp.rank)  # the survey-style per-rank seed, on purpose  # ddp-lab: ignore[DDP006]
    model = nn.Linear(8, 4)
    before = digest(model.parameters())
    model = DDP(model, process_group=grp.pg)         # hvd.broadcast_parameters(model.state_dict(), 0)
    grp.record(kind="pair", name="broadcast_parameters", before=before, after=digest(model.parameters()))

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(2, 8)).sum().backward()         # every rank: DDP all-reduces the gradients
    if grp.rank == 0:
        optimizer.step()                             # only rank 0 has moments, as if it alone had
                                                     # loaded them from a checkpoint
    after_ddp = optim_digest(optimizer)
    state = [optimizer.state_dict() if grp.rank == 0 else None]
    dist.broadcast_object_list(state, group=grp.pg, group_src=0)         # hvd.broadcast_optimizer_state(optimizer, 0)
    optimizer.load_state_dict(state[0])
    grp.record(kind="pair", name="optimizer_state", after_ddp=after_ddp, after_broadcast=optim_digest(optimizer))

    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    n = len(x) // grp.world_size
    mine = slice(grp.rank * n, (grp.rank + 1) * n)
    with torch.no_grad():
        per_example = F.cross_entropy(model.module(x[mine]), y[mine], reduction="none")  # Reduction.NONE
        total = per_example.sum() / len(x)           # compute_average_loss(global_batch_size=16)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=grp.pg)  # strategy.reduce(ReduceOp.SUM, ...)
        whole = F.cross_entropy(model.module(x), y).item()
    grp.record(kind="pair", name="average_loss", reduced=total.item(), one_process=whole)
    del model, optimizer


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    os.environ.setdefault(runtime.BACKEND_ENV, "gloo")  # CPU tensors, counted on CPU: GPUs or not
    with runtime.distributed() as ctx:
        run_all(Group.of(ctx))


if __name__ == "__main__":
    main()
