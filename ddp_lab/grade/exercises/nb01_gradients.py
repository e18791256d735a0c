"""01.4: average the gradients by hand, as DDP does, on 2 real ranks.

Each rank runs forward and backward on its half of a batch with a plain model (no DDP), then
the answer averages every gradient across the ranks. The reference is the gradient of the
whole batch in one model: the big-batch gradient DDP promises.
"""
from ddp_lab.grade.core import MANY_OPS, Exercise, close, register, within

BATCH = 8


def _setup():
    import torch
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    g = torch.Generator().manual_seed(11)
    return model, torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 2, generator=g)


def on_rank(answer, rank, world):
    import torch.nn.functional as F
    model, x, y = _setup()
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    F.mse_loss(model(x[mine]), y[mine]).backward()
    local = [p.grad.clone() for p in model.parameters()]
    answer(model)
    big, xb, yb = _setup()
    F.mse_loss(big(xb), yb).backward()
    names = [n for n, _ in model.named_parameters()]
    return {"names": names, "grad": [p.grad.flatten().tolist() for p in model.parameters()],
            "local": [g.flatten().tolist() for g in local],
            "reference": [p.grad.flatten().tolist() for p in big.parameters()], "world": world}


def judge(per_rank):
    import numpy as np
    problems = []
    for r, o in sorted(per_rank.items()):
        for name, got, ref, local in zip(o["names"], o["grad"], o["reference"], o["local"]):
            got, ref, local = np.array(got), np.array(ref), np.array(local)
            if close(got, ref, MANY_OPS):  # float32 sums: rounded to about 1e-7 of the gradient's size
                continue
            if close(got, ref * o["world"], MANY_OPS):
                why = f"{o['world']}x the big-batch gradient: divide the all-reduced sum by the world size"
            elif close(got, local, MANY_OPS):
                why = "still this rank's own gradient: all-reduce every parameter's gradient, not just some"
            elif close(got, local / o["world"], MANY_OPS):
                why = "this rank's gradient divided by the world size: all-reduce it before dividing"
            else:
                why = (f"max difference {np.abs(got - ref).max():.3g} {within(MANY_OPS)}: all-reduce (sum) "
                       f"p.grad, then divide by the world size")
            problems.append(f"rank {r}: the gradient of `{name}` is {why}")
    return problems


register(Exercise(
    id="01.4", notebook="01_dataparallel_vs_ddp", title="Average gradients by hand",
    skills="what DDP's all-reduce does: sum every gradient across ranks, divide by N; "
           "equal to the big-batch gradient",
    answer="average_gradients(model): every p.grad becomes the mean over the ranks",
    nproc=2, on_rank=on_rank, judge=judge))
