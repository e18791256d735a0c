"""05.5: the learning rate for K micro-steps on N ranks; graded in the kernel.

The reference is the lesson's ddp_lab.lessons.accumulation.scaled_lr: the batch behind one optimizer step
is per-rank batch x ranks x micro-steps; SGD scales the learning rate linearly with its growth
(Goyal et al. 2017), Adam-family optimizers by its square root (Malladi et al. 2022).
"""
import math

from ddp_lab.grade import core
from ddp_lab.grade.core import Exercise, register

# (base lr, batch it was tuned for, per-rank batch, ranks, micro-steps K, optimizer)
CASES = [(0.1, 256, 32, 4, 2, "sgd"), (0.1, 256, 64, 8, 4, "sgd"), (1e-3, 128, 16, 4, 8, "adamw"),
         (3e-4, 512, 32, 8, 2, "adamw"), (0.05, 64, 16, 2, 1, "sgd")]
RULE = {"sgd": "linear", "adamw": "sqrt"}

WRONG = [
    (lambda lr, b, p, n, k, o: lr * (p * n / b if o == "sgd" else math.sqrt(p * n / b)),
     "the batch behind one step counts the micro-steps too: per-rank batch x ranks x K"),
    (lambda lr, b, p, n, k, o: lr * p * n * k / b,
     "Adam-family optimizers scale by the square root of the batch's growth, not linearly"),
    (lambda lr, b, p, n, k, o: lr * math.sqrt(p * n * k / b),
     "plain SGD scales linearly with the batch's growth; the square root is for Adam"),
    (lambda lr, b, p, n, k, o: lr * (n * k if o == "sgd" else math.sqrt(n * k)),
     "the growth is relative to the batch the learning rate was tuned for: effective batch / base batch"),
]


def on_rank(answer, rank, world):
    return {"cases": [[list(c), float(answer(*c))] for c in CASES]}


def judge(per_rank):
    from ddp_lab.lessons import accumulation as A
    cases = [(tuple(c), got) for c, got in per_rank[0]["cases"]]
    close = lambda x, y: core.close(x, y, core.FEW_OPS)  # noqa: E731  (a product and a square root)
    culprit = next((w for f, w in WRONG if all(close(got, f(*c)) for c, got in cases)), None)
    problems = []
    for c, got in cases:
        lr, b, p, n, k, o = c
        ref = A.scaled_lr(lr, b, p, n, k, RULE[o])
        if close(got, ref):
            continue
        why = culprit or next((w for f, w in WRONG if close(got, f(*c))),
                              "lr x growth (SGD) or lr x sqrt(growth) (Adam), growth = effective / base batch")
        problems.append(f"{o}, lr {lr:g} tuned for batch {b}, {p} per rank x {n} ranks x K={k}: you said "
                        f"{got:.4g}, it is {ref:.4g} {core.within()}: {why}")
    return problems[:2]


register(Exercise(
    id="05.5", notebook="05_gradient_accumulation", title="The learning rate for K micro-steps",
    skills="effective batch = per-rank batch x ranks x K; linear rule for SGD, square root for Adam",
    answer="lr_for(base_lr, base_batch, per_rank_batch, world_size, k, optimizer) -> learning rate",
    nproc=0, on_rank=on_rank, judge=judge))
