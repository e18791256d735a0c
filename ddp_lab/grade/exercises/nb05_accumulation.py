"""05.4: one optimizer step per window of K micro-batches under DDP, on 2 real ranks.

The answer is called for two windows; DDP's all-reduces are counted with a comm hook. The
reference is a plain model (no DDP) that takes one SGD step per window on every rank's
micro-batches at once: the big batch the accumulation stands for.
"""
from ddp_lab.grade.core import MANY_OPS, Exercise, close, register, within
from ddp_lab.lessons import plural

K, BATCH, LR, WINDOWS = 4, 3, 0.1, 2


def _data(rank, window):
    import torch
    g = torch.Generator().manual_seed(500 + 10 * window + rank)
    return [(torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(K)]


def _model():
    import torch
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def on_rank(answer, rank, world):
    import torch
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(_model())
    calls = []

    def counting_hook(state, bucket):
        calls.append(1)
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(1))
    per_window, steps_per_window, first = [], [], None
    for w in range(WINDOWS):  # two windows: a missing zero_grad() shows in the second
        before, stepped = len(calls), len(steps)
        answer(model, optimizer, _data(rank, w))
        per_window.append(len(calls) - before)
        steps_per_window.append(len(steps) - stepped)
        first = first or [p.detach().flatten().tolist() for p in model.module.parameters()]
    weights = [p.detach().flatten().tolist() for p in model.module.parameters()]
    # The reference: the same start, one plain SGD step per window on all ranks' micro-batches.
    plain = _model()
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    start = [p.detach().clone() for p in plain.parameters()]
    for w in range(WINDOWS):
        batches = [b for r in range(world) for b in _data(r, w)]
        opt.zero_grad()
        sum(F.mse_loss(plain(x), y) for x, y in batches).div(len(batches)).backward()
        opt.step()
        if w == 0:
            deltas = [(p.detach() - s).flatten().tolist() for p, s in zip(plain.parameters(), start)]
    reference = [p.detach().flatten().tolist() for p in plain.parameters()]
    start = [s.flatten().tolist() for s in start]
    return {"weights": weights, "first_window": first, "reference": reference, "start": start,
            "ref_delta": deltas, "allreduces": per_window, "steps": steps_per_window}


def _flat(lists):
    import numpy as np
    return np.concatenate([np.array(x) for x in lists])


def _scaled_step(ratio: float, world: int) -> str:
    """Why a step points the right way but is `ratio` times the reference's size."""
    for factor, why in ((K, f"divide each micro-batch's loss by K = {K} (or the accumulated gradient is K "
                            f"times too big)"),
                        (K / world, f"the loss was divided by the world size ({world}), not by K = {K}: DDP "
                                    f"already averages over the ranks, so divide each micro-batch's loss by K"),
                        (1 / world, f"the loss was divided by the world size ({world}) as well as by K = {K}: "
                                    f"DDP already averages over the ranks, so divide by K only")):
        if abs(ratio - factor) < 0.05 * factor:
            return f"every weight moved {factor:g}x as far as the reference: {why}"
    return (f"every weight moved {ratio:.3g}x as far as the reference: divide each micro-batch's loss by "
            f"K = {K}, and by nothing else")


def judge(per_rank):
    import numpy as np
    problems = []
    w = {r: _flat(o["weights"]) for r, o in per_rank.items()}
    o0, world = per_rank[0], len(per_rank)
    ref, start, ref_delta = _flat(o0["reference"]), _flat(o0["start"]), _flat(o0["ref_delta"])
    delta = _flat(o0["first_window"]) - start  # the first window starts where the reference did
    ratio = float(np.dot(delta, ref_delta) / np.dot(ref_delta, ref_delta))
    steps = {r: o["steps"] for r, o in per_rank.items()}
    if any(s != [1] * WINDOWS for s in steps.values()):  # each hint only where its condition holds
        r, s = next((r, s) for r, s in sorted(steps.items()) if s != [1] * WINDOWS)
        calls = max(s, key=lambda n: abs(n - 1))
        problems.append(f"rank {r} called optimizer.step() {plural(calls, 'time')} in a window of {K} "
                        f"micro-batches: call it once per window, after the K-th backward")
    elif not all(close(w[r], w[0], MANY_OPS) for r in w):
        never = all(c == 0 for o in per_rank.values() for c in o["allreduces"])
        problems.append("the ranks ended with different weights: " + (
            "DDP never all-reduced, so the last micro-batch of each window must run outside no_sync()"
            if never else "every rank must take the same step from the all-reduced gradients"))
    elif not close(w[0], ref, MANY_OPS):
        if close(delta, ref_delta, MANY_OPS):
            problems.append("the first window's step equals the reference, the second does not: the second "
                            "window started with the first's gradients; call optimizer.zero_grad() once per "
                            "window")
        elif abs(ratio - 1) > 0.05 and close(delta, ratio * ref_delta, 1e-3):
            problems.append(_scaled_step(ratio, world))
        else:
            problems.append(f"the weights differ from one SGD step per window on all ranks' micro-batches "
                            f"(max difference {np.abs(w[0] - ref).max():.3g} {within(MANY_OPS)}): each window's "
                            f"step must come from the gradients of its own {K} micro-batches, each loss / K")
    for r, o in sorted(per_rank.items()):
        counts = o["allreduces"]
        if counts != [1] * len(counts) and not problems:
            problems.append(
                f"DDP all-reduced {plural(counts[0], 'time')} in a window of {K} micro-batches on rank {r}, a correct "
                f"loop does it once (the last micro-batch): no_sync() must wrap the forward as well as "
                f"backward(), because DDP decides during forward whether the next backward syncs")
    return problems


register(Exercise(
    id="05.4", notebook="05_gradient_accumulation", title="Accumulate with no_sync under DDP",
    skills="no_sync around forward and backward; one all-reduce per window; loss / K; one "
           "optimizer step per window",
    answer="accumulate(model, optimizer, micro_batches): K forward/backward passes, one optimizer step",
    nproc=2, on_rank=on_rank, judge=judge))
