"""Rank 1 raises while rank 0 waits at a barrier: the root cause is rank 1's error."""
import torch.distributed as dist

from ddp_lab.engine import runtime

with runtime.distributed() as ctx:
    if ctx.rank == 1:
        raise ValueError("shard 7 is corrupt (rank 1's own error)")
    dist.barrier()
