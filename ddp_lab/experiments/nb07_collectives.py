"""Notebook 07, section 1 and the deep dive on mismatched collectives: a rank that skips a
collective, and collectives that do not match.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb07_collectives
    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb07_collectives --abort
    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb07_collectives --cases shape_detail
    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb07_collectives --dumps DIR

Each failure runs in a fresh process group of its own (a 3 s timeout), so one launch can show
several: the error each rank raised is caught and recorded (kind="case"), then the next case
starts on a new group. The cases, in order:

  skip        rank 0 all-reduces a metric inside `if rank == 0:`; rank 1 moves on. Plain gloo:
              rank 0 times out, and the message names no culprit.
  skip_detail the same, with rank 1 going on to the end-of-epoch barrier, under
              TORCH_DISTRIBUTED_DEBUG=DETAIL: a fingerprint check before every collective names
              what each rank is running.
  monitored   rank 1 never reaches the barrier; rank 0 calls dist.monitored_barrier, which
              names the rank that did not arrive.
  fixed       every rank runs the all-reduce (rank 0 alone would print it): no error.
  shape_detail, dtype_detail
              all_reduce of 4 vs 8 elements, float32 vs float64, under DETAIL.
With --abort, last: the 4 vs 8 all_reduce on plain gloo, which gloo cannot survive.

With --dumps DIR, each rank leaves what a hung job leaves for `ddp-lab autopsy` in DIR/<case>/,
the files ddp_lab.engine.launch's autopsy writes when a rank dies of an exception: torch's Flight
Recorder dump (the case's group only) and the traceback it raised (rank{R}.exception.json), or,
for a rank that raised nothing, where it was instead (rank{R}.request.json).
"""
import argparse
import datetime
import json
import os
import pickle
import sys

import torch
import torch.distributed as dist

from ddp_lab.engine import runtime
from ddp_lab.lessons.troubleshooting import LATE_RANK

CASE_TIMEOUT = datetime.timedelta(seconds=3)


def group(detail: bool):
    dist.set_debug_level(dist.DebugLevel.DETAIL if detail else dist.DebugLevel.OFF)
    g = dist.new_group(backend="gloo", timeout=CASE_TIMEOUT)
    dist.set_debug_level(dist.DebugLevel.OFF)
    return g


def skip_alone(ctx, g):
    metric = torch.tensor([float(ctx.rank)])
    if ctx.rank == 0:                     # the bug: a collective only rank 0 runs
        dist.all_reduce(metric, group=g)
    # rank 1 has moved on: it waits for rank 0 at the next step (here, main()'s barrier)


def skip(ctx, g):
    metric = torch.tensor([float(ctx.rank)])
    if ctx.rank == 0:                     # the bug: a collective only rank 0 runs
        dist.all_reduce(metric, group=g)
    dist.barrier(group=g)                 # end of epoch: every rank


def fixed(ctx, g):
    metric = torch.tensor([float(ctx.rank)])
    dist.all_reduce(metric, group=g)      # the fix: every rank joins, rank 0 alone prints
    dist.barrier(group=g)
    return {"sum": metric.item()}


def monitored(ctx, g):
    if ctx.rank == LATE_RANK:             # busy elsewhere (or stuck): never arrives
        return
    dist.monitored_barrier(group=g, timeout=CASE_TIMEOUT)


def shape(ctx, g):
    dist.all_reduce(torch.ones(4 if ctx.rank == 0 else 8), group=g)


def dtype(ctx, g):
    dist.all_reduce(torch.ones(4, dtype=torch.float32 if ctx.rank == 0 else torch.float64), group=g)


def _frames(tb_or_frame, traceback: bool) -> list:
    out = []
    while tb_or_frame is not None:
        frame, line = (tb_or_frame.tb_frame, tb_or_frame.tb_lineno) if traceback else (tb_or_frame, tb_or_frame.f_lineno)
        out.append({"file": frame.f_code.co_filename, "line": line, "name": frame.f_code.co_name})
        tb_or_frame = tb_or_frame.tb_next if traceback else tb_or_frame.f_back
    return out if traceback else out[::-1]


def dump_case(folder: str, rank: int, g, exc: BaseException | None) -> None:
    """What this rank leaves for the autopsy after one case: the Flight Recorder's entries of the
    case's group (torch's own dump, without Python frames: symbolizing them costs seconds), and
    the traceback of the error it raised, or its stack (it moved on: the caller's line)."""
    os.makedirs(folder, exist_ok=True)
    fr = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False))
    fr["entries"] = [e for e in fr.get("entries", []) if e.get("process_group", [None])[0] == g.group_name]
    with open(os.path.join(folder, f"fr_trace_rank_{rank}"), "wb") as f:
        pickle.dump(fr, f)
    if exc is not None:
        dump = {"exception": {"type": type(exc).__name__, "message": str(exc)[:2000],
                              "frames": _frames(exc.__traceback__, traceback=True)}}
        name = "exception"
    else:
        dump = {"threads": [{"main": True, "frames": _frames(sys._getframe(1), traceback=False)}]}
        name = "request"
    with open(os.path.join(folder, f"rank{rank}.{name}.json"), "w") as f:
        json.dump(dump, f)


CASES = [("skip", skip_alone, False), ("skip_detail", skip, True), ("monitored", monitored, False),
         ("fixed", fixed, False),
         ("shape_detail", shape, True), ("dtype_detail", dtype, True)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--abort", action="store_true", help="end with a mismatch on plain gloo")
    parser.add_argument("--dumps", help="leave each case's Flight Recorder entries and stacks in DUMPS/<case>/")
    parser.add_argument("--cases", default=",".join(name for name, _, _ in CASES),
                        help="comma-separated cases to run, in the order above (default: all)")
    args = parser.parse_args(argv)
    chosen = args.cases.split(",")
    unknown = sorted(set(chosen) - {name for name, _, _ in CASES})
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {[name for name, _, _ in CASES]}")
    with runtime.distributed() as ctx:
        for name, case, detail in (c for c in CASES if c[0] in chosen):
            g = group(detail)
            caught = None
            try:
                out, error = case(ctx, g) or {}, None
            except Exception as exc:          # recorded for the notebook; the next case gets a new group
                out, error, caught = {}, f"{type(exc).__name__}: {exc}", exc
            if args.dumps:
                dump_case(os.path.join(args.dumps, name), ctx.rank, g, caught)
            ctx.record(kind="case", case=name, error=error, **out)
            dist.barrier()                    # the default group is healthy: line up for the next case
        if args.abort:
            print(f"rank {ctx.rank}: all_reduce of {4 if ctx.rank == 0 else 8} elements on plain gloo",
                  flush=True)
            shape(ctx, group(False))
            print(f"rank {ctx.rank}: survived the mismatch", flush=True)
            sys.exit(0)


if __name__ == "__main__":
    main()
