"""05.4: one optimizer step per window of K micro-batches under DDP, on 2 real ranks.

The answer is called for two windows; DDP's all-reduces are counted with a comm hook. The
reference is a plain model (no DDP) that takes one SGD step per window on every rank's
micro-batches at once: the big batch the accumulation stands for.
"""
from ddp_lab.grade.core import Exercise, register
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
    per_window, first = [], None
    for w in range(WINDOWS):  # two windows: a missing zero_grad() shows in the second
        before = len(calls)
        answer(model, optimizer, _data(rank, w))
        per_window.append(len(calls) - before)
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
            "ref_delta": deltas, "allreduces": per_window}


def _flat(lists):
    import numpy as np
    return np.concatenate([np.array(x) for x in lists])


def judge(per_rank):
    import numpy as np
    problems = []
    w = {r: _flat(o["weights"]) for r, o in per_rank.items()}
    o0 = per_rank[0]
    ref, start, ref_delta = _flat(o0["reference"]), _flat(o0["start"]), _flat(o0["ref_delta"])
    if not all(np.allclose(w[r], w[0], atol=1e-6) for r in w):
        problems.append("the ranks ended with different weights: the last micro-batch of each window must "
                        "run outside no_sync(), so that DDP all-reduces the accumulated gradients once")
    elif not np.allclose(w[0], ref, atol=1e-5):
        delta = _flat(o0["first_window"]) - start  # the first window starts where the reference did
        ratio = float(np.dot(delta, ref_delta) / np.dot(ref_delta, ref_delta))
        if abs(ratio - K) < 0.05 * K and np.allclose(delta, K * ref_delta, atol=1e-4):
            problems.append(f"every weight moved {K}x as far as the reference: divide each micro-batch's "
                            f"loss by K = {K} (or the accumulated gradient is K times too big)")
        else:
            problems.append(f"the weights differ from one SGD step per window on all ranks' micro-batches "
                            f"(max difference {np.abs(w[0] - ref).max():.3g}): call optimizer.step() and "
                            f"optimizer.zero_grad() once per window, after the K-th backward")
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
