"""When does DDP pay off on a CPU? Step time on 1 rank vs 2 ranks (1 thread each).

    .venv/bin/python benchmarks/bench_scaling.py [--steps 60]

Weak scaling, as DDP is used: every rank keeps the same batch, so 2 ranks process twice the
samples per step. Perfect scaling keeps the step time flat (speed-up 2.0x in samples/s). Two
models through scripts/train_ddp.py on digits:
- cnn: much compute per sample, 0.15 M parameters to all-reduce: compute-bound, scales well;
- wide_mlp: 8.5 M parameters (34 MB of gradients per step, ~35-70 ms over loopback gloo) and,
  at batch 8 per rank, about as little compute: communication-bound, the all-reduce eats the gain.
Step time is the median over windows of 10 steps (start-up and evaluation excluded), from
train_ddp.py's own samples/s. Prints the numbers; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def step_time(model: str, nproc: int, steps: int, batch_size: int) -> float:
    from ddp_lab.engine import launch

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "m.jsonl"
        launch.torchrun("train_ddp.py", nproc=nproc, threads=1, stream=False, args=[
            "--model", model, "--max-steps", steps, "--batch-size", batch_size, "--epochs", 100,
            "--log-every", 10, "--metrics-out", out])
        recs = [json.loads(line) for line in out.read_text().splitlines()]
    sps = [r["samples_per_s"] for r in recs if r["kind"] == "train"][1:]  # skip the warm-up window
    return batch_size * nproc / statistics.median(sps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    print(f"step time, 1 thread per rank, gloo, {args.steps} steps, digits")
    print(f"{'model':<10} {'batch/rank':>10} {'1 rank ms':>10} {'2 ranks ms':>11} {'t2/t1':>7} {'speed-up':>9}")
    for model, batch in (("cnn", 64), ("wide_mlp", 8)):
        t1 = step_time(model, 1, args.steps, batch)
        t2 = step_time(model, 2, args.steps, batch)
        print(f"{model:<10} {batch:>10} {1e3 * t1:>10.1f} {1e3 * t2:>11.1f} {t2 / t1:>7.2f} "
              f"{2 * t1 / t2:>8.2f}x", flush=True)
    print("speed-up = samples/s on 2 ranks / samples/s on 1 rank (2.00x is perfect). On a busy or "
          "2-core machine two ranks also compete for cores; compare the two models, not the absolutes.")


if __name__ == "__main__":
    main()
