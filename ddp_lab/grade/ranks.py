"""The program a grading launch runs on every rank.

    python -m torch.distributed.run --nproc-per-node 2 -m ddp_lab.grade.ranks JOBS.pkl

JOBS.pkl holds [(exercise id, label, packed answer), ...]. Each rank runs every job in order
and records its observations (or the answer's error, in one line) as a JSON line. After a job
that failed on this rank the group may hold a half-finished send or a timed-out collective, so
the rank stops there; the kernel launches the jobs that did not finish again.
"""
import datetime
import gc
import os
import pickle
import sys

import torch
import torch.distributed as dist

from ddp_lab.engine import runtime
from ddp_lab.grade import core, exercises  # noqa: F401  (exercises fills core.REGISTRY)


def main(path: str) -> None:
    with open(path, "rb") as f:
        jobs = pickle.load(f)
    ctx = _join()
    for exercise_id, label, blob in jobs:
        exercise = core.REGISTRY[exercise_id]
        try:
            obs = exercise.on_rank(core.unpack(blob), ctx.rank, ctx.world_size)
        except Exception as exc:  # the learner's error is the finding, not a crash of the grader
            ctx.record(kind="graded", job=label, error=core.error_text(exc))
            sys.stdout.flush()
            # The group may hold work that never completes (a recv with no sender): leaving the
            # normal way would wait on it, or abort at exit. Its record is written; stop here.
            os._exit(0)
        ctx.record(kind="graded", job=label, obs=obs)
    gc.collect()  # DDP models of the answers freed while the group exists (see runtime.distributed)
    runtime.teardown()


def _join() -> runtime.Context:
    """A gloo group whose every call, point to point included, fails after RANK_TIMEOUT_S.

    The group's timeout is fixed when it is made, and making it waits on the other ranks with
    that same timeout; so every rank first waits (longer) until all have started, then joins.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    wait = datetime.timedelta(seconds=runtime.DEFAULT_TIMEOUT_S * 2)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=wait))
    store.set(f"grade/started/{rank}", "1")
    store.wait([f"grade/started/{r}" for r in range(world)], wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=core.RANK_TIMEOUT_S))
    return runtime.Context(rank, world, int(os.environ.get("LOCAL_RANK", rank)),
                           int(os.environ.get("LOCAL_WORLD_SIZE", world)), torch.device("cpu"),
                           "gloo", True)


if __name__ == "__main__":
    main(sys.argv[1])
