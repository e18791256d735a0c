"""Reading a checkpoint back on N ranks, and writing one in shards. One launch, four probes:

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb06_load_and_shard --dir /tmp/ck

1. save on rank 0, then barrier: when rank 1 leaves the barrier the new file is complete.
2. the engineering article's load_checkpoint (every rank reads the file) vs rank 0 reads + broadcast:
   bytes each rank reads from storage, seconds, and whether all ranks end up equal.
3. the half-fix: load on rank 0 only, then DDP(model). DDP's constructor broadcasts
   the weights, but rank 1's optimizer state stays empty.
4. torch.distributed.checkpoint (DCP): each rank writes only its shard of a sharded
   (DTensor) state dict, then loads it back; rank 0 also saves the full weights so a
   single process can check DCP's resharding load against them.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.lessons import checkpointing as ck
from ddp_lab.lessons import models
from ddp_lab.engine import runtime

try:  # public since torch 2.5
    from torch.distributed.tensor import Shard, distribute_tensor
except ImportError:  # pragma: no cover
    from torch.distributed._tensor import Shard, distribute_tensor
from torch.distributed.device_mesh import init_device_mesh


def digest(model) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def trained(width: int):
    """A model plus an optimizer that has taken one step (so it has state to lose)."""
    torch.manual_seed(0)
    model = models.wide_mlp(width=width, depth=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    F.cross_entropy(model(torch.randn(8, 1, 8, 8)), torch.arange(8)).backward()
    optimizer.step()
    return model, optimizer


def fresh(width: int):
    # every rank starts different on purpose: loading must fix that
    torch.manual_seed(100 + dist.get_rank())  # ddp-lab: ignore[DDP006]
    model = models.wide_mlp(width=width, depth=2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def probe_barrier(ctx, folder):
    path = os.path.join(folder, "barrier.pt")
    if ctx.is_main:
        ck.atomic_save({"step": 0}, path)
    dist.barrier()
    for label, use_barrier, step in (("no barrier", False, 1), ("barrier", True, 2)):
        if ctx.is_main:
            time.sleep(0.5)  # slow storage: the save takes a while
            ck.atomic_save({"step": step}, path)
            t_saved = time.time()
        if use_barrier:
            dist.barrier()  # NEW: nobody reads (or exits) before rank 0 finished writing
        seen = torch.load(path, weights_only=True)["step"]
        t_read = time.time()
        dist.barrier()
        ctx.record(kind="barrier", mode=label, step_written=step, step_seen=seen,
                   t_read=t_read, t_saved=t_saved if ctx.is_main else None)


def probe_loaders(ctx, folder, width):
    path = os.path.join(folder, "big.pt")
    if ctx.is_main:
        model, optimizer = trained(width)
        ck.atomic_save(ck.make_checkpoint(model, optimizer, step=1), path)
        ctx.record(kind="reference", digest=digest(model), bytes=os.path.getsize(path))
    dist.barrier()
    for mode in ("every rank reads", "rank 0 reads + broadcast"):
        model, optimizer = fresh(width)
        dist.barrier()
        t0 = time.perf_counter()
        if mode == "every rank reads":
            state, nread = ck.load_every_rank(path)
        else:
            state, nread = ck.load_on_rank0_and_broadcast(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        seconds = time.perf_counter() - t0
        ctx.record(kind="load", mode=mode, bytes_read=nread, seconds=seconds,
                   digest=digest(model), opt_state=len(optimizer.state))
    # The half-fix: rank 0 loads, DDP's constructor broadcasts parameters and buffers only.
    model, optimizer = fresh(width)
    if ctx.is_main:
        state, _ = ck.counted_load(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    ddp = DDP(model)
    ctx.record(kind="load", mode="rank 0 loads, DDP broadcasts", bytes_read=None, seconds=None,
               digest=digest(ddp.module), opt_state=len(optimizer.state))


def probe_dcp(ctx, folder):
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    torch.manual_seed(0)
    model = models.mlp()
    # Sharded along dim 0: each rank holds 1/world_size of every tensor (as FSDP would).
    sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in model.state_dict().items()}
    target = os.path.join(folder, "dcp")
    t0 = time.perf_counter()
    dcp.save({"model": sharded}, checkpoint_id=target)  # NEW: every rank writes its own file
    seconds = time.perf_counter() - t0
    if ctx.is_main:
        torch.save(model.state_dict(), os.path.join(folder, "dcp_reference.pt"))
    local = {k: list(v.to_local().shape) for k, v in sharded.items()}
    back = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in model.state_dict().items()}
    dcp.load({"model": back}, checkpoint_id=target)  # every rank reads only what it holds
    equal = all(torch.equal(back[k].to_local(), sharded[k].to_local()) for k in sharded)
    dist.barrier()
    files = {f: os.path.getsize(os.path.join(target, f)) for f in sorted(os.listdir(target))}
    ctx.record(kind="dcp", local_shapes=local, full_shapes={k: list(v.shape) for k, v in
               model.state_dict().items()}, roundtrip_equal=equal, files=files, seconds=seconds)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="a folder every rank can reach (shared storage)")
    p.add_argument("--width", type=int, default=1024, help="wide_mlp width of the loaded model")
    args = p.parse_args(argv)
    with runtime.distributed() as ctx:
        if ctx.is_main:
            os.makedirs(args.dir, exist_ok=True)
        dist.barrier()
        probe_barrier(ctx, args.dir)
        probe_loaders(ctx, args.dir, args.width)
        probe_dcp(ctx, args.dir)
        ctx.print0("nb06_load_and_shard: done")


if __name__ == "__main__":
    main()
