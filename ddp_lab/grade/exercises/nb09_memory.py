"""09.6: persistent bytes per device under DDP and ZeRO-1/2/3; graded in the kernel.

The reference is the lesson's calculator, ddp_lab.lessons.beyond.per_device, which tests/test_beyond.py
checks against the ZeRO paper's own figure (7.5B parameters on 64 GPUs: 120, 31.4, 16.6, 1.9 GB).
"""
from ddp_lab.grade import core
from ddp_lab.grade.core import Exercise, register

CASES = [(7.5e9, 64, 2, 2, 12), (7e9, 8, 4, 4, 8), (1.3e9, 4, 4, 4, 4)]  # (params, devices, w, g, o)
STAGES = ("ddp", "zero1", "zero2", "zero3")


def _split(p, n, w, g, o, stage, shards=None):
    dw, dg, do = shards or [(1, 1, 1), (1, 1, n), (1, n, n), (n, n, n)][stage]
    return p * (w / dw + g / dg + o / do)


WRONG = [
    (lambda p, n, w, g, o, s: _split(p, n, w, g, o, s) if s == 0 else p * (w + g + o) / n,
     "only ZeRO-3 splits everything: ZeRO-1 splits the optimizer state, ZeRO-2 the gradients too"),
    (lambda p, n, w, g, o, s: _split(p, n, w, g, o, min(s + 1, 3)),
     "each stage splits one more kind than the one before: ZeRO-1 only the optimizer state "
     "(w + g) P + o P / N, ZeRO-2 the gradients too"),
    (lambda p, n, w, g, o, s: p * (w + g + o) / n if s == 0 else _split(p, n, w, g, o, s),
     "DDP splits nothing: every device holds the whole (w + g + o) P"),
    (lambda p, n, w, g, o, s: _split(p, n, w, 0, o, s),
     "the gradients take g bytes per parameter too (split from ZeRO-2 on)"),
]


def on_rank(answer, rank, world):
    return {"cases": [[list(c), s, float(answer(*c, s))] for c in CASES for s in range(4)]}


def judge(per_rank):
    from ddp_lab.lessons import beyond
    rows = [(tuple(c), s, got) for c, s, got in per_rank[0]["cases"]]
    close = lambda x, y: core.close(x, y, core.FEW_OPS)  # noqa: E731  (bytes: a product and a sum)
    culprit = next((w for f, w in WRONG if all(close(got, f(*c, s)) for c, s, got in rows)), None)
    problems = []
    for c, s, got in rows:
        p, n, w, g, o = c
        ref = beyond.per_device(p, n, STAGES[s], beyond.Recipe("exercise", w, g, o))["total"]
        if close(got, ref):
            continue
        why = culprit or next((w_ for f, w_ in WRONG if close(got, f(*c, s))),
                              "(w + g) P + o P / N for ZeRO-1, w P + (g + o) P / N for ZeRO-2, "
                              "(w + g + o) P / N for ZeRO-3")
        problems.append(f"{p / 1e9:g}B parameters on {n} devices, {beyond.LABELS[STAGES[s]]} "
                        f"(w={w}, g={g}, o={o} bytes): you said {got / 1e9:.3g} GB, it is {ref / 1e9:.3g} GB "
                        f"{core.within()}: {why}")
    return problems[:2]


register(Exercise(
    id="09.6", notebook="09_beyond_ddp", title="Memory per device, ZeRO-1/2/3",
    skills="what each ZeRO stage splits: optimizer state, then gradients, then weights; bytes per "
           "parameter of each",
    answer="zero_bytes(params, world, w, g, o, stage) -> persistent bytes per device, stage 0 (DDP) to 3",
    nproc=0, on_rank=on_rank, judge=judge))
