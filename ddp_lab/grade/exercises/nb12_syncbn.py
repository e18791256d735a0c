"""12.4: SyncBatchNorm with one collective a pass, graded on 2 real ranks against BatchNorm1d on
the whole global batch in one process.

The answer is a module class, SyncBN(num_features, eps=1e-5, momentum=0.1), in training mode, with
weight, bias, running_mean and running_var as BatchNorm1d has them. The ranks hold batches of
different sizes (5 and 8 rows), so a mean of the ranks' means is wrong. Each rank's loss is
sum(y * r) for fixed random r, so the global loss is the sum over ranks and every gradient is
comparable with the one process's. Over two passes the grader compares each rank's output rows,
input gradient rows, the weight and bias gradients summed over ranks (what DDP's all-reduce would
then average) and the running statistics, and counts the collectives made in forward and in
backward: one each.

Tolerance: 1e-5 of the largest value compared (sums over 13 rows in float32).
"""
from ddp_lab.grade.core import MANY_OPS, Exercise, register, within
from ddp_lab.grade.exercises._watch import Watch, refusal, torch_own_inside

C, SIZES, PASSES = 6, (5, 8), 2


def _global(step):
    import torch
    g = torch.Generator().manual_seed(4100 + step)
    n = sum(SIZES)
    return 3 * torch.randn(n, C, generator=g) + 2, torch.randn(n, C, generator=g)


def on_rank(answer, rank, world):
    import torch
    import torch.distributed as dist
    torch.manual_seed(41)
    ref = torch.nn.BatchNorm1d(C)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(C) + 0.5)
        ref.bias.copy_(torch.randn(C))
    ours = answer(C)
    own = torch_own_inside(ours)
    if own:
        return {"refused": own}
    with torch.no_grad():
        ours.weight.copy_(ref.weight)
        ours.bias.copy_(ref.bias)
    lo = sum(SIZES[:rank])
    rows = slice(lo, lo + SIZES[rank])
    passes = []
    for step in range(PASSES):
        x, r = _global(step)
        xg = x.clone().requires_grad_()
        ref.zero_grad()
        y_ref = ref(xg)
        (y_ref * r).sum().backward()
        xl = x[rows].clone().requires_grad_()
        ours.zero_grad()
        watch = Watch()
        with watch.watching():
            watch.phase = "forward"
            y = ours(xl)
            watch.phase = "backward"
            (y * r[rows]).sum().backward()
        grads = torch.cat([ours.weight.grad.detach().clone(), ours.bias.grad.detach().clone()]).double()
        dist.all_reduce(grads)  # the grader's own sum over ranks, after the counting
        want = torch.cat([ref.weight.grad, ref.bias.grad]).double()
        diff = lambda a, b: float((a.detach().double() - b.detach().double()).abs().max())  # noqa: E731
        scale = lambda a: float(a.detach().abs().max())  # noqa: E731
        passes.append({
            "forward": [c[1] for c in watch.calls(phase="forward")],
            "backward": [c[1] for c in watch.calls(phase="backward")],
            "out": diff(y, y_ref[rows]),
            "out_scale": scale(y), "grad_in": diff(xl.grad, xg.grad[rows]), "grad_in_scale": scale(xg.grad),
            "grad_wb": diff(grads, want), "grad_wb_scale": scale(want),
            "mean": diff(ours.running_mean, ref.running_mean), "var": diff(ours.running_var, ref.running_var),
            "stat_scale": scale(ref.running_var),
            "var_biased": diff(ours.running_var, _biased_var(ref, step)),
            "no_input_grad": xl.grad is None,
            "finite": bool(y.isfinite().all()) and (xl.grad is None or bool(xl.grad.isfinite().all()))
            and bool(grads.isfinite().all()) and bool(ours.running_var.isfinite().all())})
    return {"passes": passes, "world": world}


def _biased_var(ref, step):
    """The running variance had the batch's biased variance been used (torch uses the unbiased)."""
    import torch
    running = torch.ones(C)
    for s in range(step + 1):
        x, _ = _global(s)
        running = (1 - ref.momentum) * running + ref.momentum * x.var(0, unbiased=False)
    return running


def judge(per_rank):
    if refusal(per_rank):
        return refusal(per_rank)
    problems = []
    for rank, o in sorted(per_rank.items()):
        for s, p in enumerate(o["passes"]):
            at = f"pass {s + 1}"
            if not p["finite"]:
                problems.append(f"rank {rank}'s outputs, gradients or running statistics hold NaN or inf at {at}, "
                                f"where BatchNorm1d's are finite (a negative variance? var = E[x²] − mean², with the "
                                f"global sums and the global count)")
            elif len(p["forward"]) != 1:
                problems.append(f"rank {rank} made {len(p['forward'])} collectives in forward ({', '.join(p['forward']) or 'none'}); "
                                f"one is enough: all-reduce [sum, sum of squares, count] together")
            elif not p["out"] <= MANY_OPS * p["out_scale"]:
                problems.append(f"rank {rank}'s output rows differ from BatchNorm1d on the global batch by {p['out']:.3g} "
                                f"{within(MANY_OPS, of='the largest output')}: normalise with the global mean and "
                                f"variance, from the summed counts (the ranks' batches differ in size, so a mean "
                                f"of the ranks' means is not the global mean)")
            elif len(p["backward"]) != 1:
                problems.append(f"rank {rank} made {len(p['backward'])} collectives in backward ({', '.join(p['backward']) or 'none'}): "
                                f"the input gradient needs the global sums of dy and dy * x_hat, all-reduced "
                                f"together once, in your autograd Function's backward")
            elif p["no_input_grad"] or not p["grad_in"] <= MANY_OPS * p["grad_in_scale"]:
                problems.append(f"rank {rank}'s input gradient differs from the one process's by "
                                f"{p['grad_in']:.3g} {within(MANY_OPS, of='the largest')}: dx = weight / std * "
                                f"(dy - mean(dy) - x_hat * mean(dy * x_hat)), the means over the global batch")
            elif not p["grad_wb"] <= MANY_OPS * p["grad_wb_scale"]:
                problems.append(f"the weight and bias gradients summed over the ranks differ from the one process's "
                                f"by {p['grad_wb']:.3g}: each rank's are sums over its own rows of dy * x_hat and dy")
            elif not (p["mean"] <= MANY_OPS * p["stat_scale"] and p["var"] <= MANY_OPS * p["stat_scale"]):
                hint = ("the unbiased variance, times n / (n - 1) with n the global count" if p["var_biased"] <= MANY_OPS * p["stat_scale"]
                        else "running = (1 - momentum) * running + momentum * the global batch's statistic")
                problems.append(f"rank {rank}'s running statistics after {at} differ from BatchNorm1d's: use {hint}")
            else:
                continue
            break
    return problems


register(Exercise(
    id="12.4", notebook="12_build_it", title="SyncBatchNorm, one collective a pass",
    skills="a torch.autograd.Function; batch statistics from summed counts, one all-reduce in forward and "
           "one in backward; running statistics as BatchNorm keeps them",
    answer="SyncBN(num_features, eps=1e-5, momentum=0.1): an nn.Module",
    nproc=2, on_rank=on_rank, judge=judge))
