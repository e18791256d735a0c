"""10.6: keep the global batch on another world size; graded in the kernel.

The reference checks the plan itself: per-rank batch x world size x accumulation steps must be
the global batch, the per-rank batch must fit, and no plan with fewer micro-steps may exist
(found by trying every accumulation count).
"""
from ddp_lab.grade.core import Exercise, as_given, register
from ddp_lab.lessons import plural

CASES = [(512, 16, 64), (512, 4, 64), (1024, 8, 32), (768, 6, 40), (96, 3, 20)]  # (global, world, max)


def _fewest(global_batch, world, max_per_rank):
    return next(k for k in range(1, global_batch + 1)
                if global_batch % (world * k) == 0 and global_batch // (world * k) <= max_per_rank)


def on_rank(answer, rank, world):
    out = []
    for g, w, m in CASES:
        per_rank, steps = answer(g, w, m)
        out.append([g, w, m, as_given(per_rank), as_given(steps)])  # 16.0 from float32 is 16
    return {"cases": out}


def _finding(g, w, m, per_rank, steps):
    if per_rank * w * steps != g:
        if per_rank == g:
            return "the global batch is split across the ranks: each rank takes its share"
        return (f"{per_rank} x {plural(w, 'rank')} x {plural(steps, 'step')} = {per_rank * w * steps} samples "
                f"per optimizer step: per_rank x world x steps must equal the global batch")
    if per_rank > m:
        return f"{per_rank} samples do not fit on a rank (at most {m}): accumulate over more micro-steps"
    best = _fewest(g, w, m)
    if steps > best:
        return (f"{plural(best, 'micro-step')} of {g // (w * best)} per rank fit: the fewest micro-steps use the "
                f"devices best")
    return None


def judge(per_rank):
    problems = []
    for g, w, m, p, k in per_rank[0]["cases"]:
        if not (float(p).is_integer() and float(k).is_integer()):
            problems.append(f"global batch {g} on {w} ranks: you said {p:g} per rank and {k:g} steps: samples and "
                            f"micro-steps are whole numbers; divide with // where the division is exact")
            continue
        p, k = int(p), int(k)
        why = _finding(g, w, m, p, k)
        if why:
            problems.append(f"global batch {g} on {w} ranks, at most {m} per rank: you said {p} per rank, "
                            f"{plural(k, 'step')}: {why}")
    return problems[:2]


register(Exercise(
    id="10.6", notebook="10_laptop_to_cluster", title="The global batch on another world",
    skills="global batch = per-rank batch x world size x accumulation steps; fit the device; fewest "
           "micro-steps",
    answer="batch_plan(global_batch, world_size, max_per_rank) -> (per_rank_batch, accumulation_steps)",
    nproc=0, on_rank=on_rank, judge=judge))
