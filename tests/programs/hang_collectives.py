"""Hangs in collectives, one way per argument; plain torch, as a user's own program would be.

    hang_collectives.py mismatch   rank 0 calls all_reduce where rank 1 calls barrier
    hang_collectives.py rank0      a collective only on rank 0 (`if rank == 0:`)
    hang_collectives.py sleeper    rank 1 is stuck in a time.sleep loop; rank 0 waits
    hang_collectives.py save       a barrier only in rank 0's save path
    hang_collectives.py dying      rank 0 fails; its own excepthook (a log upload) still runs
                                   when rank 1's collective times out

HANG_PG_TIMEOUT (seconds, default 600): the process group's timeout; a short one makes gloo
raise on every rank instead of hanging until the launcher's timeout.
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def evaluate():
    while True:  # a stuck data source, a deadlock in user code...
        time.sleep(0.1)


def save(state, path):
    torch.save(state, path)
    dist.barrier()  # "wait until the file is written": but only rank 0 gets here


def upload_log_first(hook):
    """An excepthook that uploads the log before the traceback: the upload stalls."""
    def upload_log_excepthook(etype, value, tb):
        time.sleep(600)
        hook(etype, value, tb)
    return upload_log_excepthook


def main(how):
    timeout = datetime.timedelta(seconds=float(os.environ.get("HANG_PG_TIMEOUT", 600)))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    stats = torch.ones(3)
    for _ in range(3):  # a few collectives that match, so the mismatch is not the first
        dist.all_reduce(stats)
    print(f"rank {rank} ready", flush=True)
    if len(sys.argv) > 2:  # tell the test (outside the launcher) that this rank reached the hang
        open(f"{sys.argv[2]}.{how}.rank{rank}.ready", "w").close()
    if how == "mismatch":
        if rank == 0:
            dist.all_reduce(stats)
        else:
            dist.barrier()
    elif how == "rank0":
        if rank == 0:
            dist.all_reduce(stats)
        dist.barrier()
    elif how == "sleeper":
        if rank == 1:
            evaluate()
        dist.all_reduce(stats)
    elif how == "save":
        if rank == 0:
            save({"stats": stats}, os.devnull)
        dist.all_reduce(stats)
    elif how == "dying":
        if rank == 0:
            sys.excepthook = upload_log_first(sys.excepthook)
            raise RuntimeError("a corrupt batch on rank 0")
        dist.all_reduce(stats)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
