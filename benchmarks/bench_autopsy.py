"""What does the hang autopsy cost a job that does not hang? Step times with and without it.

    .venv/bin/python benchmarks/bench_autopsy.py [--reps 3] [--steps 300]

ddp_lab.engine.launch arms every rank for the autopsy through the environment: a sitecustomize that
registers faulthandler and parks one thread in open() on a FIFO (no work until asked), and
the Flight Recorder switched on (TORCH_FR_BUFFER_SIZE), which records every collective with its
Python frames: the only part that does work on every step. This launches the same 2-rank gloo
program with the autopsy on and off (DDP_LAB_AUTOPSY=0), alternating (on off on off ...) so
that load from other programs hits both alike, and prints the ratio of median step times for
two workloads: a small DDP training step (forward, backward with its gradient all-reduce,
optimizer step) and a step of 20 small all_reduces (the Flight Recorder's worst case: many
collectives, little compute). Asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_lab.engine import runtime

    with runtime.distributed() as ctx:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        small = torch.ones(8)
        for name in ("ddp_step", "allreduce_x20"):
            times = []
            for i in range(steps + 20):  # the first 20: warm-up, not timed
                t0 = time.perf_counter()
                if name == "ddp_step":
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                else:
                    for _ in range(20):
                        dist.all_reduce(small)
                if i >= 20:
                    times.append(time.perf_counter() - t0)
            ctx.record(kind="steps", workload=name, median_s=statistics.median(times))
        del model, optimizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3, help="launches with and without, alternating")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.steps)
        return
    from ddp_lab.engine import launch
    medians = {(on, w): [] for on in (True, False) for w in ("ddp_step", "allreduce_x20")}
    for rep in range(args.reps):
        for on in (True, False):
            env = {} if on else {"DDP_LAB_AUTOPSY": "0"}
            run = launch.torchrun([__file__, "--worker", "--steps", str(args.steps)], nproc=2, env=env,
                                  stream=False, timeout=600)
            for r in run.select(kind="steps"):
                medians[(on, r["workload"])].append(r["median_s"])
        print(f"rep {rep + 1}/{args.reps} done", flush=True)
    print(f"\nmedian step time, 2 ranks over gloo, {args.steps} steps per launch, {args.reps} launches each "
          f"(both ranks' medians pooled)")
    for w in ("ddp_step", "allreduce_x20"):
        on, off = statistics.median(medians[(True, w)]), statistics.median(medians[(False, w)])
        print(f"  {w:14s} with autopsy {on * 1e3:8.3f} ms   without {off * 1e3:8.3f} ms   "
              f"ratio with/without {on / off:.3f}")
    print("A ratio within the run-to-run spread of each side is nothing measurable; "
          "spread (max/min of the medians): " + ", ".join(
              f"{w} {'on' if on else 'off'} {max(v) / min(v):.3f}" for (on, w), v in medians.items()))


if __name__ == "__main__":
    main()
