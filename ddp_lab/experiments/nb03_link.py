"""Notebook 03, across a real link: 2 nodes x 2 ranks on the localhost cluster, one shaped link.

    launch.torchrun("-m ddp_lab.experiments.nb03_link", nproc=2, nnodes=2, link="100mbit")

Three measurements, one at a time so that no two share the link:
  link   all-reduce between rank 0 and rank 2 (one on each node): every byte crosses the link
  node   all-reduce between ranks 0 and 1 (both on node 0): loopback only
  world  all-reduce over all 4 ranks: the ring crosses the link twice, once each way

Then the bytes, counted by the kernel at each node's two interfaces (netcluster.tx_bytes(), and
loopback's counter), for one all-reduce of LAYOUT_BYTES over all 4 ranks and for one step of the
two hybrid (HSDP-style) layouts of 2 nodes x 2 ranks: the gradients reduce-scattered over the
shard group, the shard all-reduced over the replicate group, the parameters all-gathered over
the shard group.
  flat               one all-reduce over the 4 ranks
  replicate across   shard group = the ranks of a node, replicate group = one rank per node
  shard across       shard group = one rank per node, replicate group = the ranks of a node

Records: kind = "sweep" (where = "link" | "node", sizes, seconds) and "world" (bytes, seconds),
from rank 0; seconds are the median of the timed calls. kind = "bytes" (layout, node, link, loop:
bytes the node sent over its link and over its loopback), from each node's local rank 0.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ddp_lab.engine import netcluster, runtime

SIZES = [64 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024]   # bytes
WORLD_BYTES = 4 * 1024 * 1024
ITERS, WARMUP = 3, 1
LAYOUT_BYTES = 2 * 1024 * 1024


def loop_tx() -> int:
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


def hybrid_step(grads, shard, replicate):
    """One step of a hybrid layout's collectives (what HSDP runs per step, by hand)."""
    n = dist.get_world_size(shard)
    piece = torch.empty(grads.numel() // n)
    dist.reduce_scatter_tensor(piece, grads, group=shard)
    dist.all_reduce(piece, group=replicate)
    dist.all_gather_into_tensor(torch.empty_like(grads), piece, group=shard)


def count_bytes(ctx, layout, step):
    """The bytes each node sends over its link and its loopback while `step` runs (every rank)."""
    dist.barrier()
    before = (netcluster.tx_bytes(), loop_tx())
    dist.barrier()
    step()
    dist.barrier()
    if ctx.local_rank == 0:
        link, loop = netcluster.tx_bytes() - before[0], loop_tx() - before[1]
        ctx.record(kind="bytes", layout=layout, node=ctx.rank // ctx.local_world_size, link=link, loop=loop)


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
        per = ctx.local_world_size
        nodes = [list(range(k * per, (k + 1) * per)) for k in range(ctx.world_size // per)]
        columns = [list(range(j, ctx.world_size, per)) for j in range(per)]
        groups = {name: [dist.new_group(g) for g in gs] for name, gs in (("nodes", nodes), ("columns", columns))}
        mine = lambda name: next(g for g, ranks in zip(groups[name], nodes if name == "nodes" else columns)
                                 if ctx.rank in ranks)
        grads = torch.ones(LAYOUT_BYTES // 4)
        count_bytes(ctx, "flat", lambda: dist.all_reduce(grads))
        count_bytes(ctx, "replicate across", lambda: hybrid_step(grads, mine("nodes"), mine("columns")))
        count_bytes(ctx, "shard across", lambda: hybrid_step(grads, mine("columns"), mine("nodes")))
        ctx.print0(f"link, node and world all-reduces timed on {ctx.world_size} ranks; bytes counted")


if __name__ == "__main__":
    main()
