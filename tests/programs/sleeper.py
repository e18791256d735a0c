"""Every rank records its pid, then sleeps: for timeout/interrupt/kill tests."""
import os
import sys
import time

from ddp_lab.engine import runtime

with runtime.distributed() as ctx:
    ctx.record(kind="pid", pid=os.getpid(), ppid=os.getppid())
    marker = sys.argv[1] if len(sys.argv) > 1 else ""
    if marker and ctx.is_main:  # tell the test (outside the launcher) that we are up
        with open(marker + ".ready", "w") as f:
            f.write(str(os.getpid()))
    print(f"rank {ctx.rank} sleeping", flush=True)
    time.sleep(600)
