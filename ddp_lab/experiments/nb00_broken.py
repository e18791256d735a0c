"""A program with a bug on one rank, to see what a failed launch looks like (notebook 00).

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb00_broken
"""
import argparse

import torch
import torch.distributed as dist

from ddp_lab.engine import runtime


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    with runtime.distributed() as ctx:
        x = torch.ones(3 if ctx.rank == 0 else 4)  # rank 1 built the wrong shape...
        if x.numel() != 3:
            raise ValueError(f"rank {ctx.rank}: expected 3 values, got {x.numel()} (check the data shard)")
        dist.all_reduce(x)


if __name__ == "__main__":
    main()
