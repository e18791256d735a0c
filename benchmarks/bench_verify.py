"""What does `ddp-lab verify` cost? A 2-rank verify of a small script beside a plain launch of it.

    .venv/bin/python benchmarks/bench_verify.py [--reps 2] [--script tests/verify_scripts/good_plain.py]

Runs the same script through ddp_lab.engine.launch.torchrun (2 ranks, no observer) and through
ddp_lab.verify.verify (2 ranks, each simulated node one rank, the observer armed), alternating
(plain verify plain verify ...) so that load from other programs hits both alike, and prints each
one's median wall time and their ratio. Asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=2, help="launches of each kind, alternating")
    p.add_argument("--script", default=str(ROOT / "tests" / "verify_scripts" / "good_plain.py"))
    args = p.parse_args()
    from ddp_lab.engine import launch
    from ddp_lab.verify import verify

    plain, verified = [], []
    here = os.getcwd()
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as work:  # the script writes model.pt: not here
            os.chdir(work)
            try:
                t0 = time.monotonic()
                launch.torchrun(args.script, nproc=2, stream=False)
                plain.append(time.monotonic() - t0)
            finally:
                os.chdir(here)
        t0 = time.monotonic()
        report = verify(args.script)
        verified.append(time.monotonic() - t0)
        if report.status != 0:
            print(report.text())
    a, b = statistics.median(plain), statistics.median(verified)
    print(f"{Path(args.script).name}, 2 ranks, {args.reps} launches each on {os.cpu_count()} cores:")
    print(f"  plain launch   median {a:5.1f} s  ({', '.join(f'{t:.1f}' for t in plain)})")
    print(f"  ddp-lab verify median {b:5.1f} s  ({', '.join(f'{t:.1f}' for t in verified)})")
    print(f"  verify / plain: {b / a:.2f}x")


if __name__ == "__main__":
    main()
