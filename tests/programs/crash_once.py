"""Dies on the first attempt, succeeds on the restart (max_restarts)."""
import os

from ddp_lab.engine import runtime

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
with runtime.distributed() as ctx:
    ctx.record(kind="attempt", attempt=attempt)
    if attempt == 0 and ctx.rank == 1:
        raise SystemExit(3)
