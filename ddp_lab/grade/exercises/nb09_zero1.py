"""09.5: a ZeRO-1 step (sharded SGD-with-momentum state), on 2 real ranks.

Every rank holds the full flat parameter and the same averaged gradient (what DDP's
all-reduce leaves). The answer updates only this rank's shard, torch.tensor_split(param,
world)[rank], keeping momentum for that shard only, and then every rank must hold every
updated shard. The reference is torch.optim.SGD(momentum=0.9) on the whole tensor, 3 steps.
"""
from ddp_lab.grade.core import MANY_OPS, Exercise, close, register, within

NUMEL, STEPS, LR, MOMENTUM = 1001, 3, 0.1, 0.9


def _grads():
    import torch
    g = torch.Generator().manual_seed(9)
    return [torch.randn(NUMEL, generator=g) for _ in range(STEPS)]


def on_rank(answer, rank, world):
    import torch
    start = torch.linspace(-1, 1, NUMEL)
    param, state = start.clone(), {}
    for grad in _grads():
        answer(param, grad.clone(), state, LR, MOMENTUM)
    state_numel = sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor))
    ref = start.clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=LR, momentum=MOMENTUM)
    for grad in _grads():
        ref.grad = grad.clone()
        opt.step()
    return {"param": param.tolist(), "reference": ref.detach().tolist(), "start": start.tolist(),
            "state_numel": state_numel, "world": world}


def judge(per_rank):
    import numpy as np
    import torch
    problems = []
    for r, o in sorted(per_rank.items()):
        p, ref, start, n = np.array(o["param"]), np.array(o["reference"]), np.array(o["start"]), o["world"]
        shards = [(int(t[0]), int(t[-1]) + 1) for t in torch.tensor_split(torch.arange(NUMEL), n)]
        lo, hi = shards[r]
        near = lambda a, b: close(a, b, MANY_OPS, scale=np.abs(ref).max())  # noqa: E731  (3 float32 steps)
        if not near(p[lo:hi], ref[lo:hi]):
            problems.append(f"rank {r}'s own shard (elements {lo}-{hi - 1}) differs from SGD with momentum "
                            f"(max difference {np.abs(p[lo:hi] - ref[lo:hi]).max():.3g} {within(MANY_OPS)}): "
                            f"buf = momentum * buf + grad; param -= lr * buf, with buf kept in `state` between steps")
        stale = [s for s, (a, b) in enumerate(shards) if s != r and near(p[a:b], start[a:b])]
        if stale:
            problems.append(f"rank {r} still holds the old values of shard(s) {stale}: after updating its "
                            f"own shard every rank must send it to the others (dist.broadcast from the "
                            f"owner, or dist.all_gather)")
        elif not near(p, ref) and not problems:
            problems.append(f"rank {r}'s parameters differ from the reference outside its shard: every rank "
                            f"must end with every updated shard, rank s's shard from rank s")
        full = int(np.ceil(NUMEL / n))
        if o["state_numel"] > full:
            problems.append(f"rank {r} keeps {o['state_numel']} momentum values; ZeRO-1's point is that it "
                            f"keeps only its own shard's, at most {full} (1/{n} of {NUMEL})")
        if o["state_numel"] == 0:
            problems.append(f"rank {r} keeps no momentum in `state`: store this shard's buffer there, so "
                            f"the next step can use it")
    return problems


register(Exercise(
    id="09.5", notebook="09_beyond_ddp", title="A ZeRO-1 optimizer step",
    skills="shard the optimizer state (1/N per rank); update only the own shard; broadcast or "
           "all-gather the updated shards",
    answer="zero1_step(param, grad, state, lr, momentum): updates param in place on every rank",
    nproc=2, on_rank=on_rank, judge=judge))
