"""What does a private network namespace cost a launch? The same 2-rank job with and without one.

    .venv/bin/python benchmarks/bench_private_launch.py [--reps 3] [--nnodes 1]

Launches ddp_lab.experiments.nb00_hello on 2 ranks through ddp_lab.engine.launch.torchrun, in
turn on the machine's network (network=True, as before) and in a private network namespace
(ddp_lab.engine.private; with --nnodes 2 the nodes share one, as `ddp-lab verify` launches),
alternating (plain private plain private ...) so that load from other programs hits both alike.
Each time is the launch's own, from the call to its return. Prints each kind's median and their
ratio; asserts nothing. Where private namespaces are not available it says why and exits 0.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3, help="launches of each kind, alternating")
    p.add_argument("--nnodes", type=int, default=1, choices=(1, 2), help="2: one rank on each of 2 nodes")
    args = p.parse_args()
    from ddp_lab.engine import launch, private
    if not private.available():
        print(f"launches: {private.mode()}; nothing to compare")
        return
    times = {"plain": [], "private": []}
    for _ in range(args.reps):
        for kind in times:
            t0 = time.monotonic()
            launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=2 // args.nnodes,
                                  nnodes=args.nnodes, stream=False, network=kind == "plain")
            times[kind].append(time.monotonic() - t0)
    a, b = (statistics.median(times[k]) for k in times)
    print(f"nb00_hello, 2 ranks on {args.nnodes} node(s), {args.reps} launches each on {os.cpu_count()} cores:")
    for kind, t in times.items():
        print(f"  {kind:<8} median {statistics.median(t):5.2f} s  ({', '.join(f'{x:.2f}' for x in t)})")
    print(f"  private / plain: {b / a:.3f}x")


if __name__ == "__main__":
    main()
