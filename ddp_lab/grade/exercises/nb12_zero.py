"""12.3: a sharded Adam (ZeRO-1), graded on 2 real ranks against torch's ZeroRedundancyOptimizer
and against one process running torch.optim.Adam on the global batch.

The answer is a class, ShardedAdam(params, lr), with step() and a `state` holding whatever it
keeps (tensors, at any depth). The grader plays DDP: it averages the gradients across ranks
itself, then calls step(). After each of 3 steps every rank's parameters must equal both
references. The state is read from the state itself: the ranks together hold Adam's two moments
exactly once (counted in elements, so float64 moments count once too), and no rank covers more than
4/3 of max(P/N, the largest parameter) elements (fair_share: the shards may be whole parameters, as
ZeroRedundancyOptimizer's are, or slices of a flat buffer). step() makes no all-reduce: the
gradients arrive averaged.

Tolerance: 1e-5 of the largest parameter. Adam divides by the root of the second moment, so a
gradient's rounding (the global batch's mean against the mean of two halves) moves an element's
step by at most lr x that rounding's relative size.
"""
from ddp_lab.grade.core import MANY_OPS, Exercise, register, within
from ddp_lab.grade.exercises._watch import Watch, refusal, torch_own_inside

STEPS, LR, BATCH = 3, 0.01, 8


def _data(rank, step):
    import torch
    g = torch.Generator().manual_seed(3100 + 10 * step + rank)
    return torch.randn(BATCH, 32, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def _tensor_bytes(obj, seen=None) -> tuple[int, int]:
    """(bytes, elements) of every tensor with more than one element held in obj, at any depth."""
    import torch
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0, 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return (obj.numel() * obj.element_size(), obj.numel()) if obj.numel() > 1 else (0, 0)
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    total = [0, 0]
    for v in values:
        b, n = _tensor_bytes(v, seen)
        total[0] += b
        total[1] += n
    return total[0], total[1]


def on_rank(answer, rank, world):
    import copy
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from ddp_lab.lessons.build import Net
    torch.manual_seed(31)
    mine = Net()
    twin, single = copy.deepcopy(mine), copy.deepcopy(mine)
    opt = answer(list(mine.parameters()), lr=LR)
    own = torch_own_inside(opt)
    if own:
        return {"refused": own}
    zero = ZeroRedundancyOptimizer(twin.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    adam = torch.optim.Adam(single.parameters(), lr=LR)
    steps, _start_params = [], [p.detach().clone() for p in mine.parameters()]
    for step in range(STEPS):
        x, y = _data(rank, step)
        for model in (mine, twin):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            for p in model.parameters():  # what DDP leaves in .grad: the mean over the ranks
                dist.all_reduce(p.grad)
                p.grad /= world
        watch = Watch()
        with watch.watching():
            opt.step()
        reduced = [c for c in watch.calls() if c[1] in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor")]
        zero.step()
        xs = [_data(r, step) for r in range(world)]
        single.zero_grad(set_to_none=True)
        F.cross_entropy(single(torch.cat([a for a, _ in xs])), torch.cat([b for _, b in xs])).backward()
        adam.step()
        flat = lambda m: torch.cat([p.detach().flatten().double() for p in m.parameters()])  # noqa: E731
        start = torch.cat([p.flatten() for p in _start_params])
        got, ref = flat(mine), flat(single)
        moved, ref_moved = (got - start.double()).abs(), (ref - start.double()).abs()
        stale = sum(1 for p, q, r in zip(mine.parameters(), single.parameters(), _start_params)
                    if torch.equal(p.detach(), r) and not torch.equal(q.detach(), r))
        steps.append({"finite": bool(got.isfinite().all()), "reduced": len(reduced),
                      "vs_zero": float((got - flat(twin)).abs().max()), "vs_adam": float((got - ref).abs().max()),
                      "scale": float(ref.abs().max()), "moved": float(moved.max()), "stale": stale,
                      "step_ratio": float((moved / ref_moved.clamp_min(1e-12)).median())})
        _start_params = [p.detach().clone() for p in mine.parameters()]
    state_bytes, state_numel = _tensor_bytes(getattr(opt, "state", {}))
    params = list(mine.parameters())
    every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, torch.tensor([float(state_numel)], dtype=torch.float64))
    return {"steps": steps, "state_bytes": state_bytes, "state_numel": state_numel,
            "all_state_numel": [int(t) for t in every], "param_numel": sum(p.numel() for p in params),
            "largest": max(p.numel() for p in params), "world": world}


def fair_share(param_numel: int, largest: int, world: int) -> float:
    """The most parameter elements one rank's state may cover: 4/3 of the least possible maximum,
    max(P/N, the largest parameter), the bound of dealing the largest first to the lightest rank
    (ZeroRedundancyOptimizer's deal; slices of a flat buffer do better, P/N)."""
    return 4 / 3 * max(param_numel / world, largest)


def judge(per_rank):
    if refusal(per_rank):
        return refusal(per_rank)
    problems = []
    for rank, o in sorted(per_rank.items()):
        for s, step in enumerate(o["steps"]):
            tol = MANY_OPS * step["scale"]
            if not step["finite"]:
                problems.append(f"rank {rank}'s parameters hold NaN or inf after step {s + 1}, where Adam's are finite")
                break
            if step["reduced"]:
                problems.append(f"rank {rank}'s step() made {step['reduced']} all-reduce(s): the gradients arrive "
                                f"already averaged (DDP did that); a ZeRO-1 step only sends the updated shards")
                break
            if not (step["vs_zero"] <= tol and step["vs_adam"] <= tol):
                if step["moved"] <= tol:
                    problems.append(f"rank {rank}'s parameters did not change at step {s + 1}: step() must update them")
                elif step["stale"]:
                    problems.append(f"rank {rank} still holds the old values of {step['stale']} parameter(s) after step "
                                    f"{s + 1}: after updating its own shard every rank must send it to the others "
                                    f"(dist.broadcast from the owner, or dist.all_gather)")
                elif s == 0 and 2.5 < step["step_ratio"] < 4:
                    problems.append(f"rank {rank}'s first step is {step['step_ratio']:.2f}x Adam's: divide the moments "
                                    f"by (1 - beta1**t) and (1 - beta2**t), Adam's bias correction")
                else:
                    problems.append(
                        f"rank {rank}'s parameters after step {s + 1} differ from ZeroRedundancyOptimizer's by "
                        f"{step['vs_zero']:.3g} and from Adam on the global batch by {step['vs_adam']:.3g} "
                        f"{within(MANY_OPS, of='the largest parameter')}: update your shard with Adam (bias-"
                        f"corrected moments), then broadcast or all-gather every shard from its owner")
                break
        # Counted in elements, so state kept in float64 is not taken for twice the state.
        full = 2 * o["param_numel"]  # exp_avg and exp_avg_sq, one of each per parameter element
        held = sum(o["all_state_numel"])
        if o["state_numel"] == 0:
            problems.append(f"rank {rank} keeps no tensors in `state`: keep this rank's Adam moments there")
        elif held > full * 1.01:
            problems.append(f"the ranks together keep {held} elements of optimizer state, {held / full:.1f}x Adam's "
                            f"two moments ({full}): each moment element belongs to one rank only")
        elif o["state_numel"] / 2 > fair_share(o["param_numel"], o["largest"], o["world"]):
            bound = fair_share(o["param_numel"], o["largest"], o["world"])
            problems.append(f"rank {rank} keeps the moments of {o['state_numel'] // 2} of the {o['param_numel']} parameter "
                            f"elements; a fair deal keeps every rank under {bound:.0f} (4/3 of the larger of an "
                            f"even share and the largest parameter): deal the largest parameters first, each to "
                            f"the rank with the least so far")
    return problems


register(Exercise(
    id="12.3", notebook="12_build_it", title="A sharded Adam (ZeRO-1)",
    skills="partition the parameters; Adam on this rank's shard only (1/N of the state); broadcast or "
           "all-gather the updated shards; equal to ZeroRedundancyOptimizer and to Adam on the global batch",
    answer="ShardedAdam(params, lr): step(), state",
    nproc=2, on_rank=on_rank, judge=judge))
