"""Stands in for a notebook kernel: launches a program and waits (tests kill or interrupt it)."""
import signal
import sys

from ddp_lab.engine import launch

# A Jupyter kernel turns SIGINT into KeyboardInterrupt. Do the same explicitly: a process
# started in the background by a shell inherits SIGINT as *ignored*, and Python keeps that.
signal.signal(signal.SIGINT, signal.default_int_handler)

program, marker = sys.argv[1], sys.argv[2]
timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 300
try:
    link = sys.argv[4] if len(sys.argv) > 4 else None   # two nodes of the localhost cluster
    launch.torchrun(program, nproc=1 if link else 2, nnodes=2 if link else 1, link=link, args=[marker],
                    timeout=timeout, stream=False)
except KeyboardInterrupt:
    sys.exit(130)
except launch.LaunchError as e:
    print("LaunchError:", e, flush=True)
    sys.exit(2)
