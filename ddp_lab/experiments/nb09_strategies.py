"""Notebook 09, sections 2-5: one model trained with DDP, DDP + ZeroRedundancyOptimizer and FSDP2.

    torchrun --standalone --nproc_per_node=4 -m ddp_lab.experiments.nb09_strategies --folder /tmp/ck

Two jobs in one launch (starting processes is the slow part on a laptop):
  job 1  ranks 0-1 on a process group of their own, the others waiting: the three strategies, the
         FSDP2 state saved, then nb09_parallel.cpu_support (which FSDP2/ZeRO options run on gloo);
         tensor and pipeline parallelism and the TensorFlow/Horovod pairs are notebook 09b's
         (nb09b_parallelisms)
  job 2  all ranks: the three strategies again, then the checkpoint of job 1 loaded (resharded)
Each strategy trains ddp_lab.lessons.beyond.build_model() for STEPS steps on the same global batches (each
rank its slice), with Adam, and records (kind="strategy", world = the job's size, rank within it):
  losses     the global mean loss of every step
  bytes      this rank's bytes of parameters, gradients and optimizer state, summed over the
             tensors' local parts (a DTensor's to_local(), ZeroRedundancyOptimizer's own shard)
  comm       the collectives of the last step, counted as they are called: (op, payload bytes)
  gloo_ops   the same step seen by the profiler: which gloo operations really ran
The checkpoint: FSDP2 model and optimizer saved with torch.distributed.checkpoint (one file per
rank, FOLDER/dcp) plus a full copy on rank 0 (FOLDER/full.pt) to compare against (kind="saved");
job 2 loads it into a fresh FSDP2 model and optimizer and compares the full state (kind="reshard").
On several machines FOLDER must be shared storage.
"""
import argparse
import contextlib
import datetime
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from ddp_lab.engine import runtime
from ddp_lab.lessons.beyond import LR, STEPS, Group, build_model, global_batch
from ddp_lab.experiments import nb09_parallel

COMM = {"on": False, "calls": []}  # collectives called while "on": (op, payload bytes)


def _nbytes(t):
    return t.numel() * t.element_size()


def _counting(op, fn, payload):
    def wrapped(*args, **kwargs):
        if COMM["on"]:
            COMM["calls"].append((op, payload(*args, **kwargs)))
        return fn(*args, **kwargs)
    return wrapped


def _arg(name, pos):
    return lambda *a, **k: _nbytes(k[name] if name in k else a[pos])


def install_counters():
    """FSDP2 and ZeroRedundancyOptimizer call these through the torch.distributed module at call
    time, so wrapping the module's attributes sees every call. DDP all-reduces from C++; its Python
    default hook (registered in make()) calls dist.all_reduce once per bucket instead: counted too."""
    # FSDP2 calls all_gather_single / reduce_scatter_single in newer torch, all_gather_into_tensor /
    # reduce_scatter_tensor before them (torch 2.11 has only those): the same arguments, so both are wrapped
    for names, op, size in ((("all_gather_single", "all_gather_into_tensor"), "all_gather", _arg("output_tensor", 0)),
                            (("reduce_scatter_single", "reduce_scatter_tensor"), "reduce_scatter", _arg("input", 1))):
        for name in names:
            if hasattr(dist, name):
                setattr(dist, name, _counting(op, getattr(dist, name), size))
    dist.broadcast = _counting("broadcast", dist.broadcast, _arg("tensor", 0))
    dist.all_reduce = _counting("all_reduce", dist.all_reduce, _arg("tensor", 0))


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(model, optimizer) -> dict:
    """Bytes this rank holds, read from the tensors themselves (their local parts)."""
    params = list(model.parameters())
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    state = [local(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": sum(_nbytes(local(p)) for p in params),
            "grads": sum(_nbytes(local(p.grad)) for p in params if p.grad is not None),
            "optim": sum(_nbytes(t) for t in state)}


def make(strategy, grp):
    model = build_model()
    if strategy == "fsdp":
        mesh = grp.mesh()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)   # one all-gather / reduce-scatter unit per Linear
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=LR)
    model = DDP(model, process_group=grp.pg)
    model.register_comm_hook(grp.pg, default_hooks.allreduce_hook)  # the same all-reduce, visible
    if strategy == "zero1":
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR,
                                              process_group=grp.pg)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def train(grp, strategy):
    model, optimizer = make(strategy, grp)
    losses, gloo_ops = [], {}
    for step in range(STEPS):
        x, y = global_batch(step)
        n = len(x) // grp.world_size
        x, y = x[grp.rank * n:(grp.rank + 1) * n], y[grp.rank * n:(grp.rank + 1) * n]
        last = step == STEPS - 1
        COMM["on"], COMM["calls"] = last, []
        with profile(activities=[ProfilerActivity.CPU]) if last else contextlib.nullcontext() as prof:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        COMM["on"] = False
        if last:
            for e in prof.key_averages():
                if e.key.startswith("gloo:"):
                    gloo_ops[e.key] = e.count
        total = torch.tensor([loss.item() * n, n], dtype=torch.float64)
        dist.all_reduce(total, group=grp.pg)          # the global mean: [sum, count] over ranks
        losses.append((total[0] / total[1]).item())
    grp.record(kind="strategy", strategy=strategy, losses=losses,
               bytes=held_bytes(model, optimizer), comm=COMM["calls"], gloo_ops=gloo_ops,
               shapes=[list(local(p).shape) for p in model.parameters()])
    if grp.rank == 0:
        # losses are global: each is [sum, count] all-reduced over the job's ranks above
        print(f"{strategy:>5} x{grp.world_size}: loss {losses[0]:.4f} -> {losses[-1]:.4f}",  # ddp-lab: ignore[DDP008]
              flush=True)
    return model, optimizer


def full_state(model, optimizer) -> dict:
    """Every tensor of model and optimizer, gathered whole (rank 0 gets it; others get {})."""
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
    flat = {f"model.{k}": v for k, v in msd.items()}
    for pid, s in osd.get("state", {}).items():
        flat.update({f"optim.{pid}.{k}": v for k, v in s.items()})
    return flat


def save(grp, model, optimizer, folder):
    msd, osd = get_state_dict(model, optimizer)           # sharded: each rank its own pieces
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, "dcp"), process_group=grp.pg)
    full = full_state(model, optimizer)
    if grp.rank == 0:
        torch.save(full, os.path.join(folder, "full.pt"))
    grp.record(kind="saved", files=sorted(os.listdir(os.path.join(folder, "dcp"))))


def load(grp, folder):
    model, optimizer = make("fsdp", grp)                       # fresh weights: seed 0, not the trained ones
    msd, osd = get_state_dict(model, optimizer)           # the layout to fill: this world's shards
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, "dcp"), process_group=grp.pg)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    full = full_state(model, optimizer)
    if grp.rank == 0:
        saved = torch.load(os.path.join(folder, "full.pt"))
        diff = {k: float((full[k].double() - v.double()).abs().max()) for k, v in saved.items() if k in full}
        grp.record(kind="reshard", keys_saved=len(saved), keys_loaded=len(full),
                   missing=sorted(set(saved) - set(full)), max_abs_diff=max(diff.values()),
                   equal=all(torch.equal(full[k], v) for k, v in saved.items() if k in full),
                   local_shape=list(local(model[0].weight).shape))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True, help="where the first job saves its checkpoint")
    parser.add_argument("--first", type=int, default=2, help="ranks of the first job (default 2)")
    args = parser.parse_args()
    install_counters()
    os.environ.setdefault(runtime.BACKEND_ENV, "gloo")  # CPU tensors, counted on CPU: GPUs or not
    # The other ranks wait while the first job runs: a generous timeout for a loaded machine.
    with runtime.distributed(timeout=max(runtime.timeout_s(), 300)) as ctx:
        if not 0 < args.first < ctx.world_size:
            raise SystemExit(f"--first {args.first}: give fewer ranks than the launch has ({ctx.world_size})")
        first = dist.new_group(list(range(args.first)), timeout=datetime.timedelta(seconds=300))
        if ctx.rank < args.first:                     # job 1: ranks 0..first-1, on a group of their own
            grp = Group.of(ctx, first)
            for strategy in ("ddp", "zero1", "fsdp"):
                model, optimizer = train(grp, strategy)
            save(grp, model, optimizer, args.folder)
            del model, optimizer
            nb09_parallel.cpu_support(grp)
        dist.barrier()
        grp = Group.of(ctx)                           # job 2: every rank
        for strategy in ("ddp", "zero1", "fsdp"):
            model, optimizer = train(grp, strategy)
        del model, optimizer
        load(grp, args.folder)


if __name__ == "__main__":
    main()
