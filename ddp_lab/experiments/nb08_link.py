"""Notebook 08, across a real link: DDP's step on 2 nodes x 1 rank, at several link rates, one launch.

    launch.torchrun("-m ddp_lab.experiments.nb08_link", nproc=1, nnodes=2, link="unshaped", threads=1)

The cluster starts unshaped; before each phase both nodes shape what they send
(netcluster.shape), so the link runs at that rate in both directions.

1. alone: rank 0 times the step without DDP, at batch B and 2B (one device's step; rank 1 waits).
2. alpha: a 4-byte all-reduce across the link (the per-call latency; tbf adds none).
3. for each rate in RATES: an all-reduce of the gradients' size across the link, and DDP's step,
   each step after a step without DDP on both ranks at once (each rank's compute, timed beside
   the steps, under the same load: the ranks share this machine's cores).
4. on the slowest rate and unshaped: the remedies, each from the same start, timed in interleaved
   rounds (one step of each in turn), so a burst of load lands on all of them alike.

Records (rank 0; seconds are medians): kind="alone" (batch, forward, backward, optimizer),
"alpha" (seconds), "link" (rate, bytes, seconds), "step" (rate, variant, compute: the step
without DDP timed beside it (forward, backward, optimizer), seconds per micro-batch
of B samples, forward seconds, tx: bytes node 0 sent over the link per micro-batch, handed: the
bytes of each all-reduce the variant's Python code (comm hook, local SGD) handed to dist.all_reduce
over the timed `steps`).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.engine import netcluster, runtime
from ddp_lab.lessons import models

RATES = ("unshaped", "1gbit", "100mbit")
B, WIDTH, DEPTH, STEPS, WARMUP = 128, 512, 4, 5, 3
ROUNDS = {"unshaped": 15, "100mbit": 15}  # rounds per remedy rate: a short step (PowerSGD, or any step unshaped) is noisy
K = H = 4                # micro-batches per optimizer step (no_sync); steps between averages (local SGD)
REMEDIES = ("DDP", "small buckets", "bf16 hook", "PowerSGD", "no_sync x4", "local SGD x4")


def make_model():
    torch.manual_seed(0)
    return models.wide_mlp(width=WIDTH, depth=DEPTH)   # 0.8 M parameters, 3.3 MB of gradients


def batch(size):
    g = torch.Generator().manual_seed(1)
    return torch.rand(size, 64, generator=g), torch.randint(0, 10, (size,), generator=g)


def plain_step(model, opt, x, y):
    """One step without DDP: (forward, backward, optimizer) seconds."""
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def alone(size):
    """This rank's step without DDP: forward, backward, optimizer seconds (medians)."""
    model, (x, y) = make_model(), batch(size)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    parts = [plain_step(model, opt, x, y) for _ in range(WARMUP + STEPS)]
    return [statistics.median(p[i] for p in parts[WARMUP:]) for i in range(3)]


def build(variant):
    """The model `variant` trains: DDP with its buckets or comm hook, or (local SGD) the plain model."""
    model = make_model()
    if variant == "local SGD x4":
        return model
    # PowerSGD gets one bucket: on gloo, with several, each bucket's chain of all-reduces (issued from
    # the previous one's callback) interleaved differently on the two ranks here: a collective mismatch
    cap = {"small buckets": 0.25, "PowerSGD": 100.0}.get(variant)
    ddp = DDP(model, bucket_cap_mb=cap)
    if variant == "bf16 hook":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif variant == "PowerSGD":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2, min_compression_rate=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def local_sgd_average(model, world):
    """The delayed update: every H local steps, average the parameters (one all-reduce)."""
    flat = torch.nn.utils.parameters_to_vector(model.parameters())
    dist.all_reduce(flat)
    torch.nn.utils.vector_to_parameters(flat / world, model.parameters())


def one_step(model, opt, x, y, variant, i, world):
    """One optimizer step; returns (micro-batches it took, seconds of the forward whose backward syncs)."""
    micro = K if variant == "no_sync x4" else 1
    fwd = None
    for m in range(micro):
        t0 = time.perf_counter()
        if m < micro - 1:
            with model.no_sync():                      # gradients accumulate, nothing is sent
                F.cross_entropy(model(x), y).backward()
                continue
        loss = F.cross_entropy(model(x), y)
        fwd = fwd if fwd is not None else time.perf_counter() - t0
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if variant == "local SGD x4" and (i + 1) % H == 0:
        local_sgd_average(model, world)
    return micro, fwd


class Calls:
    """Count what Python code hands to dist.all_reduce (comm hooks, local SGD) during a step."""
    def __init__(self):
        self.sizes, self.inner = [], dist.all_reduce

    def __enter__(self):
        def counting(tensor, *a, **kw):
            self.sizes.append(tensor.numel() * tensor.element_size())
            return self.inner(tensor, *a, **kw)
        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.inner


class Timed:
    """One variant's model, optimizer and what its steps measured."""
    def __init__(self, variant, model):
        self.variant, self.model = variant, model
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.per, self.fwds, self.compute, self.tx, self.micro, self.handed = [], [], [], 0, 0, []


def timed(ctx, rate, variants, rounds):
    """Each variant's steps in interleaved rounds: one step of each variant in turn (a whole averaging
    period for local SGD), each after one step without DDP (both ranks at once), so a burst of load on
    this shared machine lands on every variant alike and the compute the model is given is timed
    beside the steps it predicts."""
    runs = [Timed(v, build(v)) for v in variants]
    plain = make_model()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    x, y = batch(B)
    for r in range(WARMUP + rounds):
        dist.barrier()
        for run in runs:
            steps = H if run.variant == "local SGD x4" else 1
            compute = plain_step(plain, plain_opt, x, y)
            tx0, t0 = netcluster.tx_bytes(), time.perf_counter()
            with Calls() as calls:
                for i in range(steps):
                    micro, fwd = one_step(run.model, run.opt, x, y, run.variant, i, ctx.world_size)
            seconds = (time.perf_counter() - t0) / (steps * micro)
            if r >= WARMUP:
                run.per.append(seconds)
                run.fwds.append(fwd)
                run.compute.append(compute)
                run.tx += netcluster.tx_bytes() - tx0
                run.micro += steps * micro
                run.handed += calls.sizes
    for run in runs:
        f, b, o = (statistics.median(c[k] for c in run.compute) for k in range(3))
        ctx.record(kind="step", rate=rate, variant=run.variant, seconds=statistics.median(run.per),
                   forward=statistics.median(run.fwds), compute={"forward": f, "backward": b, "optimizer": o},
                   tx=run.tx / run.micro, handed=run.handed, steps=rounds * (H if run.variant == "local SGD x4" else 1))


def link_time(nbytes, iters=3):
    t = torch.ones(nbytes // 4)
    dist.all_reduce(t)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    with runtime.distributed(timeout=120) as ctx:
        torch.set_num_threads(1)
        nbytes = 4 * models.n_params(make_model())
        if ctx.rank == 0:
            for size in (B, 2 * B):
                f, b, o = alone(size)
                ctx.record(kind="alone", batch=size, forward=f, backward=b, optimizer=o)
        dist.barrier()
        ctx.record(kind="alpha", seconds=link_time(4, iters=9))
        for rate in RATES:
            netcluster.shape(rate)
            dist.barrier()
            ctx.record(kind="link", rate=rate, bytes=nbytes, seconds=link_time(nbytes))
            variants = REMEDIES if rate in (RATES[0], RATES[-1]) else REMEDIES[:1]
            timed(ctx, rate, variants, rounds=ROUNDS.get(rate, STEPS))
            ctx.print0(f"{rate}: link and steps timed")


if __name__ == "__main__":
    main()
