"""Rank 1 raises inside runtime.distributed() and is slow to print its traceback (a busy
machine); rank 0 waits for it in an all-reduce. The error must still be rank 1's: the group
is released only after the traceback is out."""
import sys
import time

import torch
import torch.distributed as dist

from ddp_lab.engine import runtime


def slow_hook(etype, value, tb, default=sys.excepthook):
    time.sleep(3)  # what a loaded machine can do between the raise and the printed traceback
    default(etype, value, tb)


sys.excepthook = slow_hook
with runtime.distributed() as ctx:
    if ctx.rank == 1:
        raise ValueError("rank 1's own error")
    dist.all_reduce(torch.ones(1))
