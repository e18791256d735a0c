"""The chunked ring built from send/recv, checked against dist.all_reduce on real processes.

    torchrun --standalone --nproc_per_node=4 -m ddp_lab.experiments.nb03_ring

One launch of W processes checks every ring size N = 2..W: ranks 0..N-1 form a
subgroup and run ring.all_reduce_p2p and dist.all_reduce on the same inputs.
Records per N: exact equality on integer-valued floats, max difference on random
floats, bytes each rank sent ("check"); the time of dist.all_reduce and of the
hand-built ring on one 4 MB tensor per N ("bw"); and a size sweep of dist.all_reduce
on 2 ranks, 4 KB to 16 MB, for fitting the alpha-beta model ("sweep"). Timings are
taken in interleaved rounds, each round on its slowest rank, and reported as the median
round (and, for the sweep, also the fastest round, which other work on a busy machine
disturbs least).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

from ddp_lab.lessons import ring
from ddp_lab.engine import runtime

def check(ctx, groups, numel: int) -> None:
    """The hand-built ring against dist.all_reduce, on every ring size N."""
    for n, group in groups.items():
        if ctx.rank < n:
            g = torch.Generator().manual_seed(1000 * n + ctx.rank)
            # Integer-valued floats add exactly in any order: the two results must be identical.
            ints = torch.randint(-100, 100, (numel,), generator=g).float()
            floats = torch.randn(numel, generator=g, dtype=torch.float64)
            mine, theirs = ints.clone(), ints.clone()
            info = ring.all_reduce_p2p(mine, group=group)
            dist.all_reduce(theirs, group=group)
            f_mine, f_theirs = floats.clone(), floats.clone()
            ring.all_reduce_p2p(f_mine, group=group)
            dist.all_reduce(f_theirs, group=group)
            ctx.record(kind="check", n=n, equal=bool(torch.equal(mine, theirs)),
                       max_diff_float64=(f_mine - f_theirs).abs().max().item(),
                       bytes_sent=info["bytes_sent"], steps=info["steps"],
                       nbytes=ints.numel() * ints.element_size())
        dist.barrier()


def bandwidth(ctx, groups, nbytes: int, iters: int) -> None:
    """Bandwidth per ring size, and the hand-built ring against the library, same tensor.

    Interleaved: every round times each (N, implementation) once, so a machine that gets
    busier or quieter during the run slows every variant alike and their ratios hold."""
    x = torch.ones(nbytes // 4)
    variants = [(n, label) for n in groups for label in ("all_reduce", "p2p_ring")]
    def call(n, label):
        if label == "all_reduce":
            dist.all_reduce(x, group=groups[n])
        else:
            ring.all_reduce_p2p(x, group=groups[n])
    times = {v: torch.zeros(iters, dtype=torch.float64) for v in variants}
    for i in range(-1, iters):  # round -1 is the warm-up
        for n, label in variants:
            if ctx.rank < n:
                x.fill_(1.0)
                dist.barrier(group=groups[n])
                t0 = time.perf_counter()
                call(n, label)
                if i >= 0:
                    times[n, label][i] = time.perf_counter() - t0
            dist.barrier()
    for n, label in variants:
        if ctx.rank < n:
            # A call ends when its slowest rank ends; the median shrugs off a busy machine's spikes.
            dist.all_reduce(times[n, label], op=dist.ReduceOp.MAX, group=groups[n])
            if ctx.rank == 0:
                ctx.record(kind="bw", n=n, impl=label, bytes=x.numel() * 4,
                           time_s=times[n, label].median().item())
        dist.barrier()


def sweep(ctx, pair, sizes: list[int], iters: int) -> None:
    """The size sweep on ranks 0 and 1, interleaved in the same way, for the cost model."""
    bufs = {b: torch.ones(b // 4) for b in sizes}
    times = {b: torch.zeros(iters, dtype=torch.float64) for b in sizes}
    for i in range(-1, iters):
        for b in sizes:
            if ctx.rank < 2:
                dist.barrier(group=pair)
                t0 = time.perf_counter()
                dist.all_reduce(bufs[b], group=pair)
                if i >= 0:
                    times[b][i] = time.perf_counter() - t0
            dist.barrier()
    for b in sizes:
        if ctx.rank < 2:
            dist.all_reduce(times[b], op=dist.ReduceOp.MAX, group=pair)
            if ctx.rank == 0:
                ctx.record(kind="sweep", n=2, bytes=b, time_s=times[b].median().item(),
                           time_min_s=times[b].min().item())
        dist.barrier()


def parse_size(text: str) -> int:
    """Bytes from a size such as 4K, 16M or 100."""
    units = {"K": 2**10, "M": 2**20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=1003)            # not divisible by 2, 3 or 4
    p.add_argument("--bw-bytes", type=int, default=4 * 2**20)    # size for the algbw/busbw table
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--sweep", default="4K,16K,64K,256K,1M,4M,16M")  # all_reduce sizes on 2 ranks
    # Small all-reduces take well under a millisecond, so on a busy machine one preempted call
    # moves a median of 8; 32 rounds cost about a second and steady the fit of alpha.
    p.add_argument("--sweep-iters", type=int, default=32)
    args = p.parse_args(argv)
    # A CPU lesson: gloo and CPU tensors even on a GPU machine (one GPU cannot host two NCCL
    # ranks, and the measurements compare with the CPU numbers elsewhere in the notebook).
    os.environ.setdefault(runtime.BACKEND_ENV, "gloo")
    with runtime.distributed() as ctx:
        # new_group must be called by every rank, in the same order, even by non-members.
        groups = {n: dist.new_group(list(range(n))) for n in range(2, ctx.world_size + 1)}
        check(ctx, groups, args.numel)
        bandwidth(ctx, groups, args.bw_bytes, args.iters)
        sweep(ctx, groups[2], [parse_size(t) for t in args.sweep.split(",")], args.sweep_iters)
        ctx.print0(f"p2p ring checked against dist.all_reduce for N = 2..{ctx.world_size}")


if __name__ == "__main__":
    main()
