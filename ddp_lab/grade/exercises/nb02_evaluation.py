"""02.4: the exact accuracy of a model on a dataset split over 2 real ranks.

11 samples on 2 ranks: DistributedSampler pads rank 1's shard with a copy of sample 0. The
reference is the accuracy over the 11 samples in one process; the wrong answers learners give
(padding counted, one rank's shard only, a mean of per-rank accuracies) each have a different
value here, so the grader can say which one it got.
"""
from ddp_lab.grade.core import FEW_OPS, Exercise, close, register, within
from ddp_lab.lessons import plural

N_SAMPLES = 11
CORRECT = {0, 1, 2, 3, 5, 8, 9}  # sample 0, the one the sampler repeats, is classified right


def task():
    """(model, dataset): the same on every rank and in the kernel."""
    import torch
    torch.manual_seed(2)
    model = torch.nn.Linear(3, 3)
    x = torch.randn(N_SAMPLES, 3)
    with torch.no_grad():
        pred = model(x).argmax(1)
    y = torch.tensor([int(p) if i in CORRECT else (int(p) + 1) % 3 for i, p in enumerate(pred)])
    return model, torch.utils.data.TensorDataset(x, y)


def on_rank(answer, rank, world):
    import torch
    model, dataset = task()
    model.eval()
    with torch.no_grad():
        value = answer(model, dataset)
    return {"value": float(value), "world": world}


def _wrong_answers(world) -> dict:
    """What each typical mistake returns on this task, computed from the sampler's own shards."""
    from torch.utils.data import DistributedSampler
    _, dataset = task()
    shards = [list(DistributedSampler(dataset, world, r, shuffle=False)) for r in range(world)]
    seen, unique = set(), []  # the shards without the sampler's repeats
    for s in shards:
        unique.append([i for i in s if i not in seen])
        seen.update(s)
    acc = lambda idx: sum(i in CORRECT for i in idx) / len(idx)  # noqa: E731
    return {
        "padded": (sum(sum(i in CORRECT for i in s) for s in shards) / sum(map(len, shards)),
                   f"the padding was counted: DistributedSampler repeats "
                   f"{plural(sum(map(len, shards)) - N_SAMPLES, 'sample')} so that every rank gets as many; "
                   f"count only the first len(dataset) indices (or drop the repeats) before you all-reduce [correct, count]"),
        "mean of means": (sum(acc(s) for s in shards) / world,
                          "a mean of the ranks' accuracies weighs every rank equally, padding included: "
                          "all-reduce [correct, count] and divide once"),
        "mean of unpadded means": (sum(acc(s) for s in unique) / world,
                                   "a mean of the ranks' accuracies is wrong when shards differ in size: "
                                   "all-reduce [correct, count] and divide once"),
        **{f"rank {r} only": (acc(s), f"that is rank {r}'s own shard: all-reduce [correct, count] across "
                                      f"the ranks before dividing") for r, s in enumerate(shards)},
    }


def judge(per_rank):
    exact = len(CORRECT) / N_SAMPLES
    world = per_rank[0]["world"]
    problems = []
    for r, o in sorted(per_rank.items()):
        v = o["value"]
        if close(v, exact, FEW_OPS):  # a ratio of counts: float32 holds it to 6e-8
            continue
        why = [hint for value, hint in _wrong_answers(world).values() if close(v, value, FEW_OPS)]
        problems.append(f"rank {r} returned {v:.4f}; the exact accuracy over the {N_SAMPLES} samples is "
                        f"{len(CORRECT)}/{N_SAMPLES} = {exact:.4f} {within(FEW_OPS, 'a ratio of counts')}: "
                        + (why[0] if why else "count correct predictions and samples on each rank, "
                           "all-reduce both, divide once"))
    return problems


register(Exercise(
    id="02.4", notebook="02_sampler_and_metrics", title="Exact distributed accuracy",
    skills="DistributedSampler padding; all-reduce [correct, count], not a mean of means; "
           "the same answer on every rank",
    answer="exact_accuracy(model, dataset) -> float, the same on every rank",
    nproc=2, on_rank=on_rank, judge=judge))
