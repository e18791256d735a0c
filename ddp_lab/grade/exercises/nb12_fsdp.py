"""12.5 (deep dive): FSDP in miniature, graded on 2 real ranks against FSDP2's fully_shard.

The answer is a class, MiniFSDP(module): it replaces every nn.Linear of lessons.build.Net with a
layer of its own that keeps only this rank's share of the layer's weight and bias as parameters,
gathers the whole layer for its forward and frees it after, and leaves in each share's .grad the
mean over the ranks of the gradient of that share (reduce-scattered; gloo has no reduce-scatter of
its own, so an all-reduce and a slice stand in for it). The grader trains it and, beside it, a copy
under fully_shard (one unit per Linear, as notebook 09 does) with SGD for three steps, on the same
data, and compares each step's global loss and global gradient norm.

What it also reads:
- the parameter elements each rank holds between steps: its shares, at most one padded 1/N of
  every layer (`memory`);
- what autograd keeps for backward during forward (torch.autograd.graph.saved_tensors_hooks): a
  whole layer's weight kept there is a gathered weight not freed after forward.

Tolerance: 1e-5 of the value compared (sums of a few products in float32, in another order).
"""
from ddp_lab.grade.core import MANY_OPS, Exercise, register, within
from ddp_lab.grade.exercises._watch import refusal, torch_own_inside

STEPS, LR, BATCH = 3, 0.1, 8


def _data(rank, step):
    import torch
    g = torch.Generator().manual_seed(5100 + 10 * step + rank)
    return torch.randn(BATCH, 32, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def _global_mean(value, world):
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / world


def _grad_norm(params):
    import torch
    import torch.distributed as dist
    sq = torch.zeros(1, dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            sq += g.double().pow(2).sum()
    dist.all_reduce(sq)
    return float(sq.sqrt())


def on_rank(answer, rank, world):
    import copy
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from ddp_lab.lessons.build import Net
    torch.manual_seed(51)
    model = Net()
    twin = copy.deepcopy(model)
    shapes = {s for m in model.modules() if isinstance(m, torch.nn.Linear)
              for s in (tuple(m.weight.shape), tuple(m.weight.shape)[::-1])}  # a weight, or its transpose
    full_sizes = {m.weight.numel() + m.bias.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    layers = [m.weight.numel() + m.bias.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ours = answer(model)
    own = torch_own_inside(ours)
    if own:
        return {"refused": own}
    for m in twin.modules():
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(twin)
    held = sum(p.numel() for p in ours.parameters())
    opt = torch.optim.SGD(ours.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(twin.parameters(), lr=LR)
    kept, steps = [], []

    def pack(t):
        if tuple(t.shape) in shapes or (t.dim() == 1 and t.numel() in full_sizes):
            kept.append(tuple(t.shape))
        return t

    for step in range(STEPS):
        x, y = _data(rank, step)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(ours(x), y)
        loss.backward()
        ref_loss = F.cross_entropy(twin(x), y)
        ref_loss.backward()
        steps.append({"loss": _global_mean(loss.item(), world), "ref_loss": _global_mean(ref_loss.item(), world),
                      "norm": _grad_norm(ours.parameters()), "ref_norm": _grad_norm(twin.parameters())})
        opt.step()
        ref_opt.step()
    del twin
    return {"steps": steps, "held": held, "layers": layers, "kept": sorted(set(kept)), "world": world}


def judge(per_rank):
    import math
    if refusal(per_rank):
        return refusal(per_rank)
    problems = []
    for rank, o in sorted(per_rank.items()):
        share = sum(math.ceil(n / o["world"]) for n in o["layers"])
        if o["held"] > share:  # (the losses and norms of unsharded layers are not FSDP's to compare)
            problems.append(f"rank {rank} holds {o['held']} parameter elements between steps; its shares are "
                            f"{share} (1/{o['world']} of each layer, padded): keep only this rank's share as a "
                            f"Parameter, and the gathered layer only while it runs")
            continue
        if o["kept"]:
            problems.append(f"autograd kept whole layers ({', '.join(map(str, o['kept']))}) from forward for "
                            f"backward on rank {rank}: the gathered weight is not freed after forward; save only the "
                            f"input and your share in an autograd Function, and gather again in its backward")
        for s, step in enumerate(o["steps"]):
            if not all(math.isfinite(step[k]) for k in ("loss", "norm")):
                problems.append(f"rank {rank}'s loss or gradient norm at step {s + 1} is NaN or inf")
                break
            if not abs(step["loss"] - step["ref_loss"]) <= MANY_OPS * abs(step["ref_loss"]):
                problems.append(f"the global loss at step {s + 1} is {step['loss']:.6g}, FSDP2's {step['ref_loss']:.6g} "
                                f"{within(MANY_OPS)}: forward must use the whole gathered layer (every rank's share, "
                                f"in rank order)")
                break
            if not abs(step["norm"] - step["ref_norm"]) <= MANY_OPS * step["ref_norm"]:
                ratio = step["norm"] / step["ref_norm"] if step["ref_norm"] else float("inf")
                why = (f"{o['world']}x FSDP2's: the reduce sums; divide by the world size" if abs(ratio - o["world"]) < 0.05
                       else f"{ratio:.3g}x FSDP2's: each share's gradient is the mean over the ranks of the gradient "
                            f"of that slice of the layer")
                problems.append(f"the global gradient norm at step {s + 1} is {why}")
                break
    return list(dict.fromkeys(problems))


register(Exercise(
    id="12.5", notebook="12_build_it", title="FSDP in miniature (deep dive)",
    skills="shard each layer 1/N; gather for forward and free after (an autograd Function that saves the "
           "input and the share); gather again in backward; reduce-scatter the gradient (all-reduce and slice "
           "on gloo); equal to FSDP2's fully_shard",
    answer="MiniFSDP(module): an nn.Module whose Linear layers keep 1/N shares",
    nproc=2, on_rank=on_rank, judge=judge))
