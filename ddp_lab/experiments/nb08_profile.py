"""Notebook 08: profile real DDP steps on every rank, and time them without the profiler.

    torchrun --standalone --nproc_per_node=4 -m ddp_lab.experiments.nb08_profile --out runs/08_profiling
    python -m ddp_lab.experiments.nb08_profile --out runs/08_profiling --sizes 1    # one rank

One launch compares several world sizes (--sizes, default 1,2,4, each at most the launch's):
a configuration "model on N ranks" runs DDP on a process group of ranks 0..N-1 while the other
ranks wait at a barrier. Models: small (a tiny MLP) and wide (a 3-layer MLP of width 1024),
trained on random 8x8 images with a fixed global batch split over the N ranks.

- timing: --rounds rounds, each running --steps steps of every configuration in turn
  (interleaved, so a machine that gets busier or quieter slows every configuration alike);
  perf_counter per step ("timing" records).
- profiling: --profile steps per configuration under torch.profiler; one Chrome trace per rank
  in OUT/{model}_n{N}/rank{R}.json ("profiled" records give each step's perf_counter time).
  Phases are marked with record_function (ddp_lab/step, /data, /forward, /backward,
  /optimizer), as ddp_lab.lessons.profiling expects.
- --straggler-ms: the small model on 2 ranks, rank 1 sleeping that long in its data loading
  (OUT/straggler_n2/); --logging: three ways to log the loss, on 2 ranks, in interleaved
  rounds; --sweep: dist.all_reduce on 2 ranks at a few sizes, for the alpha-beta fit.
"""
import argparse
import itertools
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_lab.lessons import models
from ddp_lab.engine import runtime

MARK = "ddp_lab/"
MODELS = {"small": lambda: models.mlp(hidden=64), "wide": lambda: models.wide_mlp(width=1024, depth=3)}


def dataset(size=1500):
    """Random 8x8 images and labels, the digits' shapes: the time of a step does not depend on the
    values, and skipping scikit-learn's import saves each rank a second of CPU at start-up."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(size, 1, 8, 8, generator=g), torch.randint(0, 10, (size,), generator=g))


def batches(n, rank, global_batch, seed=0):
    """An endless iterator over this rank's shard (of n) of the data, epoch after epoch."""
    data = dataset()
    sampler = DistributedSampler(data, n, rank, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(data, batch_size=global_batch // n, sampler=sampler, drop_last=True)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def make(name, ctx, group):
    torch.manual_seed(0)
    model = DDP(MODELS[name]().to(ctx.device), process_group=group)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_step(model, optimizer, it, ctx, sleep_s=0.0, log="none", acc=None):
    """One step, its phases marked for the profiler. log: how the loss is logged; the seconds
    the logging itself took are added to acc["log_s"], each global-loss reduction's to acc["calls"]."""
    with record_function(MARK + "step"):
        with record_function(MARK + "data"):
            x, y = next(it)
            x, y = x.to(ctx.device), y.to(ctx.device)
            if sleep_s:
                time.sleep(sleep_s)  # a slow disk, a heavy augmentation: this rank is late
        with record_function(MARK + "forward"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        with record_function(MARK + "backward"):
            loss.backward()
        with record_function(MARK + "optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if log == "none":
        return loss
    t0 = time.perf_counter()
    if log == "item":            # the survey's `total_loss += loss.item() * n`, every step
        acc["sum"] += loss.item() * len(y)
    elif log == "all_reduce":    # a global loss every step: on gloo a synchronous collective per step
        t = torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=ctx.device)])
        dist.all_reduce(t, group=acc["group"])
        acc["value"] = (t[0] / t[1]).item()
        acc["calls"].append(time.perf_counter() - t0)
    elif log == "every_n":       # keep the sum on the device; reduce and read it every N steps
        acc["dev"] += loss.detach() * len(y)
        acc["count"] += len(y)
        acc["steps"] += 1
        if acc["steps"] % acc["every"] == 0:
            t1 = time.perf_counter()
            t = torch.stack([acc["dev"], torch.tensor(float(acc["count"]), device=ctx.device)])
            dist.all_reduce(t, group=acc["group"])
            acc["value"] = (t[0] / t[1]).item()
            acc["calls"].append(time.perf_counter() - t1)
    acc["log_s"] += time.perf_counter() - t0
    return loss


def timed(model, optimizer, it, ctx, n, **kw):
    cuda = ctx.device.type == "cuda"
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        train_step(model, optimizer, it, ctx, **kw)
        if cuda:
            torch.cuda.synchronize()  # CUDA calls return at launch: wait for the kernels to run
        times.append(time.perf_counter() - t0)
    return times


def profiled(model, optimizer, it, ctx, n, folder, sleep_s=0.0):
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    times = []
    with profile(activities=activities) as prof:
        for _ in range(n):
            t0 = time.perf_counter()
            train_step(model, optimizer, it, ctx, sleep_s=sleep_s)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    Path(folder).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(Path(folder) / f"rank{ctx.rank}.json"))
    return times


def logging_rounds(ctx, group, global_batch, steps, rounds, every):
    """Three ways to log the loss on the small model, in interleaved rounds: the seconds per
    step of the logging code itself and of the whole step, each the median over rounds (a round
    that caught a busy moment of the machine cannot move it)."""
    model, optimizer = make("small", ctx, group)
    it = batches(2, ctx.rank, global_batch, seed=2)
    timed(model, optimizer, it, ctx, 5)
    ways = ("every_n", "item", "all_reduce")
    log_s, step_s, calls = {w: [] for w in ways}, {w: [] for w in ways}, {w: [] for w in ways}
    ran = {w: [] for w in ways}  # collectives the process group itself counted, DDP's included, per round
    for _ in range(rounds):
        for way in ways:
            acc = {"sum": 0.0, "dev": torch.zeros((), device=ctx.device), "count": 0, "steps": 0,
                   "every": every, "log_s": 0.0, "group": group, "calls": calls[way]}
            dist.barrier(group=group)
            seq = group._get_sequence_number_for_group()  # private, but gloo's and NCCL's own count
            t0 = time.perf_counter()
            for _ in range(steps):
                train_step(model, optimizer, it, ctx, log=way, acc=acc)
            step_s[way].append((time.perf_counter() - t0) / steps)
            ran[way].append(group._get_sequence_number_for_group() - seq)
            log_s[way].append(acc["log_s"] / steps)
    for way in ways:  # each round holds steps // every of every_n's all-reduces: its median is theirs
        ctx.record(kind="logging", way=way, every=every, log_s=statistics.median(log_s[way]),
                   step_s=statistics.median(step_s[way]), rounds_log_s=log_s[way], calls_s=calls[way],
                   collectives=ran[way])
    del model, optimizer


def sweep(ctx, group, sizes, iters):
    bufs = {b: torch.ones(b // 4, device=ctx.device) for b in sizes}
    times = {b: [] for b in sizes}
    for i in range(-1, iters):  # interleaved rounds; round -1 warms up
        for b in sizes:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(bufs[b], group=group)
            if i >= 0:
                times[b].append(time.perf_counter() - t0)
    for b in sizes:
        t = torch.tensor([statistics.median(times[b])], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # a call ends when its slowest rank ends
        ctx.record(kind="sweep", n=2, bytes=b, time_s=t.item())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/08_profiling")
    p.add_argument("--models", default="small,wide")
    p.add_argument("--sizes", default="1,2,4", help="world sizes to compare, each at most the launch's")
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration and round")
    p.add_argument("--profile", type=int, default=4)
    p.add_argument("--straggler-ms", type=float, default=0.0)
    p.add_argument("--logging", action="store_true")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--sweep", default="", help="all_reduce sizes in bytes, comma-separated")
    args = p.parse_args()

    with runtime.distributed() as ctx:
        sizes = [n for n in map(int, args.sizes.split(",")) if n <= ctx.world_size]
        # new_group is collective over the whole world: every rank creates every group, in order.
        wanted = sorted((set(sizes) | {2}) - {1})
        groups = {n: dist.new_group(list(range(n))) for n in wanted if n <= ctx.world_size}
        groups[1] = dist.new_group([0])
        configs = [(m, n) for m in filter(None, args.models.split(",")) for n in sizes]
        mine = {}
        for m, n in configs:
            if ctx.rank < n:
                model, optimizer = make(m, ctx, groups[n])
                it = batches(n, ctx.rank, args.global_batch)
                timed(model, optimizer, it, ctx, args.warmup)
                mine[m, n] = (model, optimizer, it, [])
        dist.barrier()
        for _ in range(args.rounds):
            for key in configs:
                if key in mine:
                    mine[key][3].extend(timed(*mine[key][:3], ctx, args.steps))
                dist.barrier()  # the others wait here, idle, while this configuration runs
        for m, n in configs:
            if (m, n) in mine:
                model, optimizer, it, times = mine[m, n]
                folder = Path(args.out) / f"{m}_n{n}"
                ptimes = profiled(model, optimizer, it, ctx, args.profile, folder)
                ctx.record(kind="timing", model=m, n=n, global_batch=args.global_batch, step_s=times,
                           params=models.n_params(model.module))
                ctx.record(kind="profiled", model=m, n=n, folder=str(folder), step_s=ptimes)
            dist.barrier()
        mine.clear()
        if ctx.world_size >= 2 and ctx.rank < 2:
            if args.straggler_ms:
                model, optimizer = make("small", ctx, groups[2])
                it = batches(2, ctx.rank, args.global_batch, seed=1)
                timed(model, optimizer, it, ctx, args.warmup)
                late = args.straggler_ms / 1e3 if ctx.rank == 1 else 0.0
                folder = Path(args.out) / "straggler_n2"
                ptimes = profiled(model, optimizer, it, ctx, args.profile, folder, sleep_s=late)
                ctx.record(kind="profiled", model="straggler", n=2, folder=str(folder), step_s=ptimes,
                           sleep_s=late)
                del model, optimizer
            if args.logging:
                logging_rounds(ctx, groups[2], args.global_batch, steps=4 * args.log_every, rounds=8,
                               every=args.log_every)
            if args.sweep:
                sweep(ctx, groups[2], [int(b) for b in args.sweep.split(",")], iters=5)
        dist.barrier()
        ctx.print0(f"profiled {args.models} on {sizes} rank(s); traces in {args.out}")


if __name__ == "__main__":
    main()
