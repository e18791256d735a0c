"""08.5: exposed communication predicted from bucket sizes and the ring model; graded in the kernel.

The reference is the lesson's model, ddp_lab.lessons.profiling.model.comm_exposed with overlap 1: each
bucket's all-reduce costs notebook 03's ring time, starts once its last gradient appears (gradients
appear at a steady rate over backward) and the previous all-reduce is done.
"""
from ddp_lab.grade import core
from ddp_lab.grade.core import Exercise, register

# (bucket sizes in bytes, in launch order; ranks; alpha s; beta s/B; backward s)
CASES = [([1e6, 25e6, 25e6], 8, 10e-6, 1 / 12.5e9, 0.02),
         ([4e6] * 4, 4, 30e-6, 1 / 3.125e9, 0.005),
         ([1e6, 10e6], 2, 50e-6, 1 / 25e9, 0.05),
         ([1e6, 25e6, 25e6, 25e6], 16, 5e-6, 1 / 25e9, 0.004)]


def _ring(size, n, alpha, beta, factor=2):
    return factor * (n - 1) * alpha + factor * (n - 1) / n * size * beta


def _serial(sizes, n, alpha, beta, t_backward, factor=2):
    total, done, end = sum(sizes), 0.0, 0.0
    for size in sizes:
        done += size
        end = max(t_backward * done / total, end) + _ring(size, n, alpha, beta, factor)
    return max(0.0, end - t_backward)


WRONG = [
    (lambda s, n, a, b, t: sum(_ring(x, n, a, b) for x in s),
     "that is all the communication; what runs before backward ends is hidden"),
    (lambda s, n, a, b, t: max(0.0, sum(_ring(x, n, a, b) for x in s) - t),
     "a bucket's all-reduce starts only when its last gradient appears (at t_backward x bytes so "
     "far / all bytes), not at the start of backward"),
    (lambda s, n, a, b, t: _ring(s[-1], n, a, b),
     "earlier buckets can still be running when backward ends: one all-reduce runs at a time, so "
     "follow every bucket's start and end"),
    (lambda s, n, a, b, t: _serial(s, n, a, b, t, factor=1),
     "a ring all-reduce is a reduce-scatter and an all-gather: 2(N-1)·α + 2(N-1)/N·S·β per bucket"),
]


def on_rank(answer, rank, world):
    return {"cases": [[list(c), float(answer(*c))] for c in CASES]}


def _near(got, want, case) -> bool:
    """Equal up to rounding: the exposed time is an end time minus t_backward, each built from
    t_backward and every bucket's ring time, so it is held to the size of their sum."""
    sizes, n, alpha, beta, t_backward = case
    return core.close(got, want, core.MANY_OPS, scale=t_backward + sum(_ring(s, n, alpha, beta) for s in sizes))


def judge(per_rank):
    from ddp_lab.lessons.profiling import model as pm
    cases = [(tuple(c), got) for c, got in per_rank[0]["cases"]]
    culprit = next((w for f, w in WRONG if all(_near(got, f(*c), c) for c, got in cases)), None)
    problems = []
    for c, got in cases:
        ref = pm.comm_exposed(c[0], *c[1:], overlap=1.0)[1]
        if _near(got, ref, c):
            continue
        why = culprit or next((w for f, w in WRONG if _near(got, f(*c), c)),
                              "walk the buckets in launch order: start = max(ready, previous end)")
        problems.append(f"{len(c[0])} buckets on {c[1]} ranks, backward {c[4] * 1e3:g} ms: you said "
                        f"{got * 1e3:.3f} ms exposed, the model gives {ref * 1e3:.3f} "
                        f"{core.within(core.MANY_OPS, of='backward plus all communication')}: {why}")
    return problems[:2]


register(Exercise(
    id="08.5", notebook="08_profiling", title="Exposed communication, predicted",
    skills="the ring model per bucket; buckets start when full and one at a time; the last bucket is "
           "always exposed",
    answer="exposed_s(sizes, n, alpha, beta, t_backward) -> predicted exposed seconds per step",
    nproc=0, on_rank=on_rank, judge=judge))
