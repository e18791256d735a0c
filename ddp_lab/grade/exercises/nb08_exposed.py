"""08.4: exposed communication time from the buckets' all-reduce intervals; graded in the kernel.

The reference is the lesson's own interval arithmetic (ddp_lab.lessons.profiling.subtract and length),
the code that profiling.budget uses on real traces.
"""
from ddp_lab.grade.core import FEW_OPS, Exercise, close, register, within

# (backward compute (start, end), [bucket all-reduce (start, end), ...]), in milliseconds
CASES = [((0.0, 6.0), [(3.0, 8.0)]),
         ((0.0, 10.0), [(2.0, 5.0), (6.0, 9.0)]),
         ((0.0, 10.0), [(4.0, 9.0), (9.0, 14.0), (15.0, 17.0)]),
         ((0.0, 5.0), [(3.0, 4.0), (6.0, 7.5)]),
         ((0.0, 8.0), [(1.0, 3.0), (5.0, 11.0)])]


def _reference(backward, buckets):
    from ddp_lab.lessons import profiling
    return profiling.length(profiling.subtract(buckets, [backward]))


WRONG = [  # (what a typical wrong answer computes, why it is wrong)
    (lambda bw, bk: sum(e - s for s, e in bk),
     "that is the whole all-reduce time; the part that runs while backward computes is hidden"),
    (lambda bw, bk: max(0.0, sum(e - s for s, e in bk) - (bw[1] - bw[0])),
     "compare when the all-reduces run with when backward computes, not only how long each takes"),
    (lambda bw, bk: max(0.0, max(e for _, e in bk) - bw[1]),
     "a gap after backward with no all-reduce running is not communication: add up only the time "
     "some bucket's all-reduce runs outside backward"),
    (lambda bw, bk: max(0.0, bk[-1][1] - max(bk[-1][0], bw[1])),
     "every bucket counts, not only the last: an early bucket can outlast backward too"),
]


def on_rank(answer, rank, world):
    return {"cases": [[list(bw), [list(b) for b in bk], float(answer(bw, list(bk)))] for bw, bk in CASES]}


def _near(got, want, backward, buckets) -> bool:
    """Equal up to rounding of the time stamps the answer subtracts (float32: 6e-8 of the largest)."""
    return close(got, want, FEW_OPS, scale=max(abs(t) for t in (*backward, *(t for b in buckets for t in b))))


def judge(per_rank):
    cases = [(tuple(bw), [tuple(b) for b in bk], got) for bw, bk, got in per_rank[0]["cases"]]
    # the wrong rule that gives every one of the answer's values names the mistake
    culprit = next((w for f, w in WRONG
                    if all(_near(got, f(bw, bk), bw, bk) for bw, bk, got in cases)), None)
    problems = []
    for bw, bk, got in cases:
        ref = _reference(bw, bk)
        if _near(got, ref, bw, bk):
            continue
        why = culprit or next((w for f, w in WRONG if _near(got, f(bw, bk), bw, bk)),
                              "exposed = the time some bucket's all-reduce runs while backward does not compute")
        problems.append(f"backward {bw}, all-reduces {bk}: you said {got:g} ms exposed, it is {ref:g} "
                        f"{within(FEW_OPS, of='the largest time')}: {why}")
    return problems[:2]


register(Exercise(
    id="08.4", notebook="08_profiling", title="Exposed communication",
    skills="overlap of bucket all-reduces with backward; exposed = communication outside compute; "
           "interval arithmetic",
    answer="exposed_ms(backward, buckets) -> milliseconds of all-reduce outside backward's compute",
    nproc=0, on_rank=on_rank, judge=judge))
