"""What do scripts/train_ddp.py's features cost? It against a bare hand-written DDP loop.

    .venv/bin/python benchmarks/bench_train.py [--reps 3] [--epochs 10] [--model mlp]

Both programs train the same model on the same data (digits, 2 ranks over gloo, batch 32 per
rank, SGD lr 0.05 momentum 0.9, DDP defaults). train_ddp.py runs with its default settings
(global-loss logging every 10 steps, LR schedule, autocast and scaler switched off, resumable
sampler, metrics file); the bare loop does forward, backward, step and nothing else. Each
program times its own training steps in windows of 10 (start-up and evaluation excluded);
the median window throughput of each run is compared. Runs alternate (A B A B ...) so that
load from other programs hits both alike. Prints the ratio; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WINDOW = 10  # steps per timing window, the same as train_ddp.py's default --log-every


def bare_worker(epochs: int, model_name: str, batch_size: int) -> None:
    """The bare loop, run by torchrun: nothing but what DDP training needs."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from ddp_lab import data, models, runtime

    with runtime.distributed() as ctx:
        dataset = data.digits("train")
        torch.manual_seed(0)
        model = DDP(models.mlp() if model_name == "mlp" else models.cnn())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sampler = DistributedSampler(dataset, ctx.world_size, ctx.rank, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        step, samples, t0 = 0, 0, time.perf_counter()
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step, samples = step + 1, samples + len(y) * ctx.world_size
                if step % WINDOW == 0:
                    t1 = time.perf_counter()
                    ctx.record(kind="window", samples_per_s=samples / (t1 - t0))
                    samples, t0 = 0, t1


def run_bare(args) -> list[float]:
    from ddp_lab import launch

    run = launch.torchrun(f"{Path(__file__).resolve()} --worker --epochs {args.epochs} --model {args.model} "
                          f"--batch-size {args.batch_size}", nproc=2, stream=False)
    return [r["samples_per_s"] for r in run.select(kind="window", rank=0)]


def run_script(args) -> list[float]:
    from ddp_lab import launch

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "m.jsonl"
        launch.torchrun("train_ddp.py", nproc=2, stream=False, args=[
            "--epochs", args.epochs, "--model", args.model, "--batch-size", args.batch_size,
            "--log-every", WINDOW, "--metrics-out", out])
        recs = [json.loads(line) for line in out.read_text().splitlines()]
    return [r["samples_per_s"] for r in recs if r["kind"] == "train"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return bare_worker(args.epochs, args.model, args.batch_size)

    print(f"train_ddp.py vs a bare DDP loop: {args.model}, digits, 2 ranks x batch {args.batch_size}, "
          f"{args.epochs} epochs, {args.reps} alternating runs each")
    bare, script = [], []
    for rep in range(args.reps):
        for name, fn, acc in (("bare loop", run_bare, bare), ("train_ddp.py", run_script, script)):
            windows = fn(args)[1:]  # the first window holds the warm-up steps
            acc.append(statistics.median(windows))
            print(f"  run {rep + 1} {name:<13} median {acc[-1]:8.0f} samples/s over {len(windows)} windows",
                  flush=True)
    b, s = statistics.median(bare), statistics.median(script)
    cost = 1 - s / b
    print(f"median samples/s: bare loop {b:.0f}, train_ddp.py {s:.0f}; ratio train_ddp/bare = {s / b:.3f}")
    verdict = "under" if cost < 0.05 else "NOT under"
    print(f"feature cost = {100 * cost:+.1f}% of throughput: {verdict} the 5% budget "
          "(a single run on a busy machine; rerun when it is quiet before concluding)")


if __name__ == "__main__":
    main()
