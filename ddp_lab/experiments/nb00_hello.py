"""First launch: every rank reports who it is, then all ranks sum their ids.

    python -m ddp_lab.experiments.nb00_hello                       # world size 1
    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb00_hello
"""
import argparse
import os
import socket

import torch
import torch.distributed as dist

from ddp_lab.engine import runtime


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    with runtime.distributed() as ctx:
        ctx.record(kind="whoami", RANK=ctx.rank, LOCAL_RANK=ctx.local_rank,
                   WORLD_SIZE=ctx.world_size, GROUP_RANK=int(os.environ.get("GROUP_RANK", 0)),
                   pid=os.getpid(), host=socket.gethostname(), device=str(ctx.device),
                   backend=ctx.backend)
        print(f"rank {ctx.rank}/{ctx.world_size} (local {ctx.local_rank}) pid {os.getpid()} on {ctx.device}")
        x = torch.tensor([float(ctx.rank)], device=ctx.device)
        dist.all_reduce(x)  # SUM by default: 0 + 1 + ... + (world_size - 1)
        ctx.record(kind="all_reduce", value=x.item())
        ctx.print0(f"all_reduce(rank ids) = {x.item():g}; expected {ctx.world_size * (ctx.world_size - 1) // 2}")


if __name__ == "__main__":
    main()
