"""01.5: which of a model's tensors DDP keeps equal on every rank, measured on 2 real ranks.

A model with BatchNorm trains 3 steps under DDP on each rank's own data, once with the default
broadcast_buffers=True and once with False. As the third forward starts (after DDP's buffer
broadcast, where section 5.3's probe looks) every rank gathers the other's state_dict; the
reference is the set of entries that are equal on both, measured, not predicted.
"""
from ddp_lab.grade.core import Exercise, register

STEPS = 3


def _measure(broadcast_buffers, rank, world):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                              torch.nn.Linear(8, 2))
    names = list(net.state_dict())
    seen = []
    hook = net.register_forward_pre_hook(lambda m, a: seen.append(
        {k: v.detach().clone() for k, v in m.state_dict().items()}))
    model = DDP(net, broadcast_buffers=broadcast_buffers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as under a sampler
    for _ in range(STEPS):
        x = torch.randn(16, 4, generator=g) * (1 + rank)
        torch.nn.functional.mse_loss(model(x), torch.zeros(16, 2)).backward()
        optimizer.step()
        optimizer.zero_grad()
    hook.remove()
    states = [None] * world
    dist.all_gather_object(states, seen[-1])
    equal = [k for k in names if all(torch.equal(s[k], states[0][k]) for s in states)]
    del model, optimizer
    return names, equal


def on_rank(answer, rank, world):
    out = {}
    for broadcast_buffers in (True, False):
        names, equal = _measure(broadcast_buffers, rank, world)
        said = answer(list(names), broadcast_buffers)
        out[str(broadcast_buffers)] = {"names": names, "equal": equal, "said": sorted(map(str, said))}
    return out


def _why(missing, extra, flag):
    stats = {"running_mean", "running_var"}
    if any(n.rsplit(".", 1)[-1] in stats for n in extra) and not flag:
        return ("with broadcast_buffers=False nothing copies the buffers: each rank's running "
                "statistics follow its own data and drift apart")
    if any(n.rsplit(".", 1)[-1] in stats for n in missing) and flag:
        return ("by default DDP copies rank 0's buffers to every rank at the start of every forward: "
                "the running statistics are equal there")
    if any(n.endswith("num_batches_tracked") for n in missing):
        return ("num_batches_tracked counts the forwards, the same number on every rank: equal even "
                "though nothing sends it")
    if any(n.endswith(("weight", "bias")) for n in missing):
        return "the parameters stay equal: the same start (DDP broadcasts it) and the same averaged gradients"
    return "compare your list with the names the grader measured as equal"


def judge(per_rank):
    problems = []
    for flag in ("True", "False"):
        o = per_rank[0][flag]
        said, equal = set(o["said"]), set(o["equal"])
        if said == equal:
            continue
        unknown = said - set(o["names"])
        if unknown:
            problems.append(f"{sorted(unknown)} are not in the model's state_dict: return names from the "
                            f"list you are given")
            continue
        missing, extra = sorted(equal - said), sorted(said - equal)
        problems.append(f"broadcast_buffers={flag}: equal on both ranks, measured: {sorted(equal)}; you left "
                        f"out {missing} and added {extra}: {_why(missing, extra, flag == 'True')}")
    return problems


register(Exercise(
    id="01.5", notebook="01_dataparallel_vs_ddp", title="What DDP keeps equal",
    skills="parameters equal through the gradient all-reduce; buffers only through broadcast_buffers; "
           "BatchNorm's running statistics",
    answer="kept_equal(names, broadcast_buffers) -> the state_dict names equal on every rank as a "
           "forward starts",
    nproc=2, on_rank=on_rank, judge=judge))
