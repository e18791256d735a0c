"""Rank 1 is killed by SIGKILL (as the OOM killer would): no traceback to show."""
import os
import signal

from ddp_lab.engine import runtime

with runtime.distributed() as ctx:
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    import time
    time.sleep(30)
