"""What do scripts/train_ddp.py's features cost? Compared with a bare hand-written DDP loop.

    .venv/bin/python benchmarks/bench_train.py [--reps 6] [--epochs 10] [--model mlp|cnn] [--window 50]

Both programs train the same model on the same data (digits, 2 ranks over gloo, batch 32 per
rank, SGD lr 0.05 momentum 0.9, DDP defaults). train_ddp.py runs with its default settings
(global-loss logging every 50 steps, LR schedule, autocast and scaler switched off, resumable
sampler, metrics file); the bare loop does forward, backward, step and nothing else. Each
program times its own training steps in windows of 50 (start-up and evaluation excluded);
the median window throughput of each run is compared, pairwise. Both run inside the same two torchrun
workers, alternating (A B A B ...), so that load from other programs hits both alike:
train_ddp.py's train() is imported and called on the same process group. Prints the ratio;
asserts nothing.
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
WINDOW = 50  # steps per timing window: train_ddp.py's default --log-every (change with --window)


def bare_loop(ctx, epochs: int, model_name: str, batch_size: int, window: int) -> list[float]:
    """The bare loop: nothing but what DDP training needs. Returns samples/s per window."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from ddp_lab.lessons import data, models

    dataset = data.digits("train")
    torch.manual_seed(0)
    model = DDP(models.mlp() if model_name == "mlp" else models.cnn())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = DistributedSampler(dataset, ctx.world_size, ctx.rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    windows, step, samples, t0 = [], 0, 0, time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step, samples = step + 1, samples + len(y) * ctx.world_size
            if step % window == 0:
                t1 = time.perf_counter()
                windows.append(samples / (t1 - t0))
                samples, t0 = 0, t1
    return windows


def worker(args) -> None:
    """Under torchrun: bare loop and train_ddp.train() alternate in the same processes."""
    import importlib.util

    from ddp_lab.engine import launch, runtime

    spec = importlib.util.spec_from_file_location("train_ddp", launch.script("train_ddp.py"))
    train_ddp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_ddp)
    with runtime.distributed() as ctx, tempfile.TemporaryDirectory() as d:
        for rep in range(args.reps):
            bare = bare_loop(ctx, args.epochs, args.model, args.batch_size, args.window)
            out = Path(d) / f"m{rep}.jsonl"
            targs = train_ddp.parse_args(["--epochs", str(args.epochs), "--model", args.model,
                                          "--batch-size", str(args.batch_size), "--metrics-out", str(out),
                                          "--log-every", str(args.window), "--progress", "off"])
            train_ddp.train(targs, ctx.rank, ctx.world_size, ctx.device, ctx.backend)
            if ctx.is_main:
                recs = [json.loads(line) for line in out.read_text().splitlines()]
                script = [r["samples_per_s"] for r in recs if r["kind"] == "train"]
                # the first window of each holds the warm-up steps
                ctx.record(kind="rep", rep=rep, bare=bare[1:], script=script[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--window", type=int, default=WINDOW, help="steps per timing window and --log-every")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from ddp_lab.engine import launch

    print(f"train_ddp.py vs a bare DDP loop: {args.model}, digits, 2 ranks x batch {args.batch_size}, "
          f"{args.epochs} epochs, {args.reps} alternating runs each, in the same two processes")
    run = launch.torchrun(f"{Path(__file__).resolve()} --worker --reps {args.reps} --epochs {args.epochs} "
                          f"--model {args.model} --batch-size {args.batch_size} --window {args.window}",
                          nproc=2, stream=False)
    bare, script = [], []
    for r in run.select(kind="rep", rank=0):
        bare.append(statistics.median(r["bare"]))
        script.append(statistics.median(r["script"]))
        print(f"  run {r['rep'] + 1}: bare loop {bare[-1]:8.0f} samples/s, train_ddp.py {script[-1]:8.0f} "
              f"samples/s (medians over {len(r['bare'])} / {len(r['script'])} windows of {args.window} steps)")
    # each run pairs two measurements taken seconds apart: the median of the pairwise ratios
    # cancels slow swings in machine load better than a ratio of two medians
    ratio = statistics.median(s / b for b, s in zip(bare, script))
    cost = 1 - ratio
    print(f"median of per-run ratios train_ddp/bare = {ratio:.3f} (per run: "
          f"{', '.join(f'{s / b:.2f}' for b, s in zip(bare, script))})")
    verdict = "under" if cost < 0.05 else "NOT under"
    print(f"feature cost = {100 * cost:+.1f}% of throughput: {verdict} the 5% budget "
          "(on a busy machine the per-run ratios scatter widely; rerun when it is quiet)")

if __name__ == "__main__":
    main()
