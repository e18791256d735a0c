"""12.2: overlap pays. Your DDP (12.1) timed against the same code with its communication moved
after backward, on 2 real ranks, where the machine can time it.

The same class trains two copies of a larger Net from the same start on the same data: one as
written, one under the grader's Watch(defer=True), where every all-reduce runs only when finish()
waits for it, after backward. Runs of STEPS steps alternate, in pairs (A then B, then B then A),
so a slow patch of the machine hits both; a run's time is the slowest rank's. The verdict is the
median ratio over the pairs, held against their spread:

- passed: the overlapped run is faster by at least 3 %, and by more than twice the spread;
- failed: it is slower by more than twice the spread, or the weights show skipped work (the two
  copies differ, the ranks disagree, or nothing moved);
- blocked: the difference is within the noise, or the machine has fewer than 2 cores per rank (a
  rank computes on one while gloo's thread moves its buckets on another; with fewer, compute and
  communication share cores and the timing measures the contention, not the overlap).

What needs no clock is judged first, on any machine: one step of the class, watched, fails it if
its communication cannot overlap backward (no async all-reduce issued during backward, or a wait
there).
"""
import os

from ddp_lab.grade.core import Blocked, Exercise, register

PAIRS, STEPS, BATCH, CAP = 7, 4, 64, 1 << 20
MIN_GAIN = 0.03


CORES_ENV = "DDP_LAB_GRADE_CORES"  # tests set it: judge as if the machine had this many cores


def cores() -> int:
    if os.environ.get(CORES_ENV):
        return int(os.environ[CORES_ENV])
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def blocked() -> str | None:
    have, need = cores(), 2 * 2
    if have >= need:
        return None
    return (f"timing the overlap needs at least {need} CPU cores for 2 ranks (one to compute, one for "
            f"gloo's communication thread, per rank); this machine gives {have}, so compute and "
            f"communication would share cores and the timing would measure that, not the overlap. "
            f"Run this check on a machine with {need} or more cores")


def _data(rank, step):
    import torch
    g = torch.Generator().manual_seed(2200 + 10 * step + rank)
    return torch.randn(BATCH, 256, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def on_rank(answer, rank, world):
    import copy
    import time
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from ddp_lab.grade.exercises._watch import Watch
    from ddp_lab.lessons.build import Net
    torch.manual_seed(22)
    base = Net(d_in=256, hidden=1024, mid=1024, classes=10)
    start = torch.cat([p.detach().flatten() for p in base.parameters()])
    models = {"overlap": answer(copy.deepcopy(base), CAP), "after": None}
    watch, seen = Watch(defer=True), Watch()  # seen: the overlapped copy's calls, run as issued
    with watch.watching():
        models["after"] = answer(copy.deepcopy(base), CAP)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    times, agree, step = {"overlap": [], "after": []}, [], 0
    # what needs no clock first: a class whose communication cannot overlap backward fails anywhere
    x, y = _data(rank, 10 ** 6)
    with seen.watching():
        seen.phase = "backward"
        F.cross_entropy(models["overlap"](x), y).backward()
        seen.phase = "finish"
        models["overlap"].finish()
    cannot = _not_overlapped(seen)
    if cannot or blocked():
        return {"not_overlapped": cannot, "blocked": blocked()}
    seen.events = []

    def run(kind):
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(STEPS):
            x, y = _data(rank, step + s)
            opts[kind].zero_grad(set_to_none=True)
            w = watch if kind == "after" else seen
            with w.watching():
                w.phase = "backward"
                F.cross_entropy(models[kind](x), y).backward()
                w.phase = "finish"
                models[kind].finish()
            opts[kind].step()
        return time.perf_counter() - t0

    for pair in range(PAIRS):
        for kind in (("overlap", "after") if pair % 2 == 0 else ("after", "overlap")):
            times[kind].append(run(kind))
        step += STEPS
        a, b = (torch.cat([p.detach().flatten() for p in models[k].parameters()]) for k in ("overlap", "after"))
        mine = a.sum().reshape(1).double()
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, mine)
        agree.append({"copies": float((a - b).abs().max()), "moved": float((a - start).abs().max()),
                      "ranks_agree": len({round(float(t), 3) for t in every}) == 1})
    return {"times": times, "agree": agree, "not_overlapped": _not_overlapped(seen), "blocked": None}


def _not_overlapped(seen) -> str | None:
    """Why the class's communication cannot overlap backward, from one step's calls; None if it can."""
    issued = [c for c in seen.calls(phase="backward") if c[1] == "all_reduce"]
    waited = [e for e in seen.events if e[0] == "wait" and e[2] == "backward"]
    return ("it issued no all_reduce during backward" if not issued else
            "it called all_reduce without async_op=True during backward" if not all(c[4] for c in issued) else
            "it waited for an all-reduce during backward" if waited else None)


def verdict(ratios: list, checks: list, not_overlapped: str | None = None) -> list:
    """The judgement from the paired runs' ratios (time after / time overlapped) and weight checks;
    not_overlapped: why the answer's communication cannot overlap backward, if it cannot."""
    import statistics
    if not_overlapped:
        return [f"nothing to time: {not_overlapped}, so its communication cannot overlap backward "
                f"(12.1 says where)"]
    for i, c in enumerate(checks):
        if not c["ranks_agree"] or c["moved"] == 0 or c["copies"] > 1e-4 * max(c["moved"], 1e-12) + 1e-6:
            what = ("the ranks' weights disagree: gradients were not all-reduced" if not c["ranks_agree"] else
                    "the weights did not move" if c["moved"] == 0 else
                    "the overlapped copy and the one communicating after backward ended with different weights")
            return [f"after pair {i + 1}, {what}: a faster run that skips work earns nothing"]
    median = statistics.median(ratios)
    spread = statistics.median(abs(r - median) for r in ratios)
    said = f"{median:.2f}x (median of {len(ratios)} paired runs, spread ±{spread:.2f})"
    if median >= 1 + MIN_GAIN and median - 1 > 2 * spread:
        return []
    if median < 1 and 1 - median > 2 * spread:
        return [f"the overlapped runs were slower than communicating after backward: {said}. Look for a "
                f"wait() or a blocking all_reduce in a hook"]
    return [Blocked(f"the speed-up, {said}, is within the noise of this machine's runs; run it again on "
                    f"a quieter machine, or with a larger model")]


def judge(per_rank):
    cannot = next((o["not_overlapped"] for o in per_rank.values() if o["not_overlapped"]), None)
    if cannot:
        return verdict([], [], cannot)
    why = next((o["blocked"] for o in per_rank.values() if o["blocked"]), None)
    if why:
        return [Blocked(why)]
    pairs = len(per_rank[0]["times"]["overlap"])
    worst = {k: [max(o["times"][k][i] for o in per_rank.values()) for i in range(pairs)] for k in ("overlap", "after")}
    ratios = [b / a for a, b in zip(worst["overlap"], worst["after"])]
    checks = [c for o in per_rank.values() for c in o["agree"]]
    return verdict(ratios, checks)


register(Exercise(
    id="12.2", notebook="12_build_it", title="Overlap pays (timed)",
    skills="measure fairly: paired, alternating runs, the median ratio against its spread, weights compared "
           "so that skipped work earns nothing; say 'blocked' where the machine cannot judge",
    answer="MyDDP from 12.1",
    nproc=2, on_rank=on_rank, judge=judge))
