"""The chunked ring built from send/recv, checked against dist.all_reduce on real processes.

    torchrun --standalone --nproc_per_node=4 -m ddp_lab.experiments.nb03_ring

One launch of W processes checks every ring size N = 2..W: ranks 0..N-1 form a
subgroup and run ring.all_reduce_p2p and dist.all_reduce on the same inputs.
Records per N: exact equality on integer-valued floats, max difference on random
floats, bytes each rank sent; then algbw and busbw of dist.all_reduce per N.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

from ddp_lab import ring, runtime

# A CPU lesson: gloo and CPU tensors even on a GPU machine (one GPU cannot host two NCCL
# ranks, and the measurements compare with the CPU numbers elsewhere in the notebook).
os.environ.setdefault(runtime.BACKEND_ENV, "gloo")

p = argparse.ArgumentParser()
p.add_argument("--numel", type=int, default=1003)            # not divisible by 2, 3 or 4
p.add_argument("--bw-bytes", type=int, default=4 * 2**20)    # size for the algbw/busbw table
p.add_argument("--iters", type=int, default=8)
args = p.parse_args()

with runtime.distributed() as ctx:
    # new_group must be called by every rank, in the same order, even by non-members.
    groups = {n: dist.new_group(list(range(n))) for n in range(2, ctx.world_size + 1)}
    for n, group in groups.items():
        if ctx.rank < n:
            g = torch.Generator().manual_seed(1000 * n + ctx.rank)
            # Integer-valued floats add exactly in any order: the two results must be identical.
            ints = torch.randint(-100, 100, (args.numel,), generator=g).float()
            floats = torch.randn(args.numel, generator=g, dtype=torch.float64)
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
    # Bandwidth per ring size, and the hand-built ring against the library, same tensor.
    count = args.bw_bytes // 4
    for n, group in groups.items():
        if ctx.rank < n:
            x = torch.ones(count)
            for label, fn in (("all_reduce", lambda: dist.all_reduce(x, group=group)),
                              ("p2p_ring", lambda: ring.all_reduce_p2p(x, group=group))):
                fn()  # warm-up
                times = torch.zeros(args.iters, dtype=torch.float64)
                for i in range(args.iters):
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    fn()
                    times[i] = time.perf_counter() - t0
                # A call ends when its slowest rank ends; the median shrugs off a busy machine's spikes.
                dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
                if ctx.rank == 0:
                    ctx.record(kind="bw", n=n, impl=label, bytes=count * 4, time_s=times.median().item())
        dist.barrier()
    ctx.print0(f"p2p ring checked against dist.all_reduce for N = 2..{ctx.world_size}")
