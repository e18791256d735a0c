"""Rank 1 dies at step 2 of a DDP training loop in one of the ways real jobs die.

    python -m torch.distributed.run --standalone --nproc_per_node 2 dies.py MODE [exit-at-once]

MODE: sigkill (as the out-of-memory killer does), sigsegv (a crash in native code),
exit3 (os._exit(3): no traceback, no cleanup), abort (a C++ abort), desync (rank 1
skips the loss all_reduce once, so rank 0's next collective meets rank 1's gradient
bucket and gloo aborts rank 0: the ranks' collectives no longer match).

exit-at-once: a rank whose collective fails prints its traceback and exits at once
(as ddp_lab.engine.runtime does) instead of lingering until torchrun stops it. Then both
deaths often land in the same torchrun poll and second, and torchrun's "Root Cause"
block names the rank with the "Connection reset" instead of the one that died first.

Plain torch.distributed, as a user's own program would be.
"""
import ctypes
import datetime
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist

mode = sys.argv[1]
exit_at_once = sys.argv[2:] == ["exit-at-once"]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def train():
    for step in range(6):
        print(f"step {step}", flush=True)
        if rank == 1 and step == 2:
            print(f"rank 1 dies now ({mode})", flush=True)
            if mode == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif mode == "sigsegv":
                ctypes.string_at(0)  # reads address 0: a real segmentation fault
            elif mode == "exit3":
                os._exit(3)
            elif mode == "abort":
                os.abort()
        loss = model(torch.randn(8, 64)).square().mean()
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        metric = loss.detach().reshape(1)
        if not (mode == "desync" and rank == 1 and step == 2):
            dist.all_reduce(metric)  # the loss for logging: every rank must join


try:
    train()
except Exception:
    if not exit_at_once:
        raise
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
dist.destroy_process_group()
