"""Notebook 03, across a real link: 2 nodes x 2 ranks on the localhost cluster, one shaped link.

    launch.torchrun("-m ddp_lab.experiments.nb03_link", nproc=2, nnodes=2, link="100mbit")

Three measurements, one at a time so that no two share the link:
  link   all-reduce between rank 0 and rank 2 (one on each node): every byte crosses the link
  node   all-reduce between ranks 0 and 1 (both on node 0): loopback only
  world  all-reduce over all 4 ranks: the ring crosses the link twice, once each way

Records: kind = "sweep" (where = "link" | "node", sizes, seconds) and "world" (bytes, seconds),
from rank 0; seconds are the median of the timed calls.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ddp_lab.engine import runtime

SIZES = [64 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024]   # bytes
WORLD_BYTES = 4 * 1024 * 1024
ITERS, WARMUP = 3, 1


def timed(tensor, group, iters=ITERS, warmup=WARMUP) -> float:
    for _ in range(warmup):
        dist.all_reduce(tensor, group=group)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sweep(ctx, members, where, group):
    """Ranks in `members` time the sizes over `group`; the others wait at the barrier."""
    seconds = []
    if ctx.rank in members:
        for nbytes in SIZES:
            seconds.append(timed(torch.ones(nbytes // 4), group))
    dist.barrier()
    if ctx.rank == members[0]:
        ctx.record(kind="sweep", where=where, n=len(members), sizes=SIZES, seconds=seconds)


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    with runtime.distributed(timeout=120) as ctx:
        torch.set_num_threads(1)
        per_node = ctx.local_world_size
        across = dist.new_group([0, per_node])          # rank 0 of node 0 and of node 1
        within = dist.new_group(list(range(per_node)))   # node 0's ranks
        sweep(ctx, [0, per_node], "link", across)
        sweep(ctx, list(range(per_node)), "node", within)
        seconds = timed(torch.ones(WORLD_BYTES // 4), None)
        if ctx.rank == 0:
            ctx.record(kind="world", n=ctx.world_size, bytes=WORLD_BYTES, seconds=seconds)
        ctx.print0(f"link, node and world all-reduces timed on {ctx.world_size} ranks")


if __name__ == "__main__":
    main()
