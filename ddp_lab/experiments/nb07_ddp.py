"""Notebook 07, deep dives on unused parameters, silent divergence and the SIGABRT at exit: what
goes wrong inside a DDP training loop.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb07_ddp

Every case builds its own tiny DDP model on a process group of its own, catches what it
raises and records it (kind="case"), so one launch shows them all:

  release          (first, automatic gc off) a model built in a function is still alive when the
                   function has returned, until gc.collect(): the teardown abort's mechanism
  unused           a branch not taken on some steps, plain DDP: the "prior iteration" error
  unused_detail    the same under TORCH_DISTRIBUTED_DEBUG=DETAIL: the parameters are named
  unused_fixed     find_unused_parameters=True, and its cost against plain DDP (timed)
  never_used       a head never used: static_graph=True
  reentrant        a layer used twice, each use in reentrant activation checkpointing, then
                   use_reentrant=False, then reentrant again with static_graph=True
  one_rank_step    optimizer.step() on rank 0 only, then on every rank: replica_check
  bn_buffers       BatchNorm with broadcast_buffers=False: replica_check names the buffers; with the
                   default broadcast it stays quiet, and the next forward makes the buffers equal
  nan              a NaN in rank 1's batch: unchecked, guarded by finite_everywhere (names the
                   rank) and by the gradient norm (no extra collective)

The models TwoHeads (an auxiliary head used on even steps) and Twice (a layer in two
checkpointed blocks) are in ddp_lab.lessons.troubleshooting, where the notebook reads their parameters.
"""
import argparse
import datetime
import gc
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.engine import runtime
from ddp_lab.lessons.troubleshooting import Twice, TwoHeads, finite_everywhere, replica_check

ALIVE = []  # weak references to every DDP model built
DEPTH = 40  # layers of the model timed with and without find_unused_parameters


def ddp(model, **kwargs):
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.OFF)  # DETAIL here is for DDP's messages, not the group
    pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    dist.set_debug_level(level)
    wrapped = DDP(model, process_group=pg, **kwargs)
    ALIVE.append(weakref.ref(wrapped))
    return wrapped


def batch(rank, step, n=16):
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data, as in real DDP
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def train(model, rank, steps, forward=lambda m, x, s: m(x), step_on=None, lr=0.1):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for s in range(steps):
        x, y = batch(rank, s)
        optimizer.zero_grad()
        F.cross_entropy(forward(model, x, s), y).backward()
        if step_on is None or rank in step_on:
            optimizer.step()
    return model


def case(ctx, name, fn, detail=False):
    torch.manual_seed(0)
    if detail:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        out, error = fn(ctx), None
    except Exception as exc:
        out, error = {}, f"{type(exc).__name__}: {exc}"
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    ctx.record(kind="case", case=name, error=error, **(out or {}))
    dist.barrier()


def release(ctx):
    """A DDP model local to a function, with its first optimizer: alive after the return?"""
    def train_once():
        train(ddp(nn.Linear(8, 4)), ctx.rank, 1)
    train_once()
    alive_after_return = sum(r() is not None for r in ALIVE)
    gc.collect()
    return {"alive_after_return": alive_after_return,
            "alive_after_collect": sum(r() is not None for r in ALIVE)}


def unused(ctx):
    train(ddp(TwoHeads()), ctx.rank, 3, forward=lambda m, x, s: m(x, use_aux=s % 2 == 0))
    return {}


def unused_fixed(ctx):
    model = train(ddp(TwoHeads(), find_unused_parameters=True), ctx.rank, 3,
                  forward=lambda m, x, s: m(x, use_aux=s % 2 == 0))
    report = replica_check(model)
    # The price: every step walks the autograd graph to find what was not used. Timed on a model
    # whose parameters are all used, so the two runs do the same work apart from that walk.
    times = {}
    models = {}
    for find in (False, True):
        torch.manual_seed(0)
        models[find] = ddp(nn.Sequential(*[nn.Linear(8, 8) for _ in range(DEPTH)], nn.Linear(8, 4)),
                           find_unused_parameters=find)
        train(models[find], ctx.rank, 3)            # warm-up
    for rnd in range(5):                            # interleaved rounds, best of each: load on a shared
        for find in (False, True):                  # machine slows some rounds, never speeds one up
            dist.barrier()
            t0 = time.perf_counter()
            train(models[find], ctx.rank, 20)
            times.setdefault(find, []).append((time.perf_counter() - t0) / 20)
    return {"identical": report.ok, "step_s_plain": min(times[False]), "step_s_find": min(times[True])}


def never_used(ctx):
    out = {}
    for static in (False, True):
        try:
            model = train(ddp(TwoHeads(), static_graph=static), ctx.rank, 3,
                          forward=lambda m, x, s: m(x, use_aux=False))
            out[f"static_{static}"] = str(replica_check(model))
        except Exception as exc:
            out[f"static_{static}"] = f"{type(exc).__name__}: {exc}"
    return out


def reentrant(ctx):
    out = {}
    for reentrant, static in ((True, False), (False, False), (True, True)):
        key = f"use_reentrant_{reentrant}" + ("_static_graph" if static else "")
        try:
            model = train(ddp(Twice(reentrant), static_graph=static), ctx.rank, 2)
            out[key] = str(replica_check(model))
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def one_rank_step(ctx):
    bug = replica_check(train(ddp(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))),
                              ctx.rank, 3, step_on={0}))
    torch.manual_seed(0)
    fixed = replica_check(train(ddp(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))),
                                ctx.rank, 3))
    return {"bug": vars(bug), "fixed": vars(fixed), "bug_text": str(bug)}


def bn_mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def bn_buffers(ctx):
    """BatchNorm without buffer broadcast (the bug) and with it (DDP's default, the fix)."""
    out = {}
    for broadcast in (False, True):
        torch.manual_seed(0)
        options = {} if broadcast else {"broadcast_buffers": False}   # the survey article's setting
        model = train(ddp(bn_mlp(), **options), ctx.rank, 3)
        out[f"broadcast_{broadcast}"] = {
            "default": vars(replica_check(model)),              # what the check reports as shipped
            "all_buffers": vars(replica_check(model, buffers=True))}
    # The default's next forward (here an evaluation) first re-sends rank 0's buffers to every rank
    model.eval()
    with torch.no_grad():
        model(batch(ctx.rank, 99)[0])
    out["broadcast_True"]["after_next_forward"] = vars(replica_check(model, buffers=True))
    out["buffers"] = [n for n, _ in model.module.named_buffers()]
    return out


def poisoned(rank, step):
    x, y = batch(rank, step)
    if rank == 1 and step == 1:
        x[3, 2] = float("nan")                  # one bad sample on one rank
    return x, y


def guarded_step(model, optimizer, x, y, guard):
    """One training step; returns None, or why every rank skipped it."""
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    own_loss_finite = bool(torch.isfinite(loss))
    if guard == "finite_everywhere":            # diagnosis: a host sync and an all_gather every step
        ok, bad = finite_everywhere(loss)
        if not ok:
            return {"own_loss_finite": own_loss_finite, "bad_ranks": bad}
    loss.backward()                             # DDP all-reduces: a NaN on one rank reaches every rank
    if guard == "grad_norm":                    # NEW: the same gradients give the same norm on every rank
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
        if not torch.isfinite(norm):            # so every rank skips together, with no extra collective
            return {"own_loss_finite": own_loss_finite, "grad_norm": str(norm.item())}
    optimizer.step()
    return None


def nan(ctx):
    out = {}
    for guard in (None, "finite_everywhere", "grad_norm"):
        torch.manual_seed(0)
        model = ddp(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        skipped = []
        for s in range(3):
            why = guarded_step(model, optimizer, *poisoned(ctx.rank, s), guard)
            if why is not None:
                skipped.append({"step": s, **why})
        out[guard or "unchecked"] = {
            "params_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "skipped": skipped, "identical": replica_check(model).ok}
    return out


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    gc.disable()  # section 7: no automatic collection, so the answer does not depend on timing
    with runtime.distributed() as ctx:
        case(ctx, "release", release)
        gc.enable()
        case(ctx, "unused", unused)
        case(ctx, "unused_detail", unused, detail=True)
        case(ctx, "unused_fixed", unused_fixed)
        case(ctx, "never_used", never_used)
        case(ctx, "reentrant", reentrant)
        case(ctx, "one_rank_step", one_rank_step)
        case(ctx, "bn_buffers", bn_buffers)
        case(ctx, "nan", nan)


if __name__ == "__main__":
    main()
