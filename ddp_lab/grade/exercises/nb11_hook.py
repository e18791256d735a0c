"""11.2: a bf16 compression hook written against DDP's comm-hook API; graded on 2 ranks.

The answer is a hook, hook(state, bucket) -> Future of the bucket's averaged gradient. The grader
registers it on a DDP model, runs one step on different data per rank, and compares each rank's
gradients with the mean of both ranks' gradients computed here by all-gathering them with no hook
(within bf16's precision), and counts the bytes the hook hands to dist.all_reduce.
"""
from ddp_lab.grade.core import Exercise, register

ATOL = 0.02   # bf16 keeps 8 bits of mantissa: gradients of this model round by under 1 %


def on_rank(answer, rank, world):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    F.cross_entropy(model(x), y).backward()           # this rank's own gradient, no DDP
    own = torch.cat([p.grad.flatten() for p in model.parameters()])
    every = [torch.zeros_like(own) for _ in range(world)]
    dist.all_gather(every, own)
    mean = torch.stack(every).mean(0)
    model.zero_grad(set_to_none=True)
    ddp = DDP(model)
    ddp.register_comm_hook(None, answer)
    sent, real = [], dist.all_reduce

    def counted(tensor, *args, **kwargs):
        sent.append((str(tensor.dtype), tensor.numel() * tensor.element_size()))
        return real(tensor, *args, **kwargs)
    dist.all_reduce = counted
    try:
        F.cross_entropy(ddp(x), y).backward()
    finally:
        dist.all_reduce = real
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    out = {"sent": sent, "fp32_bytes": own.numel() * 4,
           "max_err": float((got.float() - mean).abs().max()), "scale": float(mean.abs().max()),
           "ratio": float((got.float() * mean).sum() / (mean * mean).sum())}
    del ddp
    return out


def judge(per_rank):
    problems = []
    for rank, o in sorted(per_rank.items()):
        if not o["sent"]:
            problems.append(f"rank {rank}: your hook never called dist.all_reduce, so nothing was averaged "
                            f"across ranks: all-reduce the compressed copy (async_op=True) and chain .then()")
        elif sum(b for _, b in o["sent"]) >= o["fp32_bytes"]:
            problems.append(f"rank {rank}: your hook sent {sum(b for _, b in o['sent'])} bytes, as many as the "
                            f"fp32 gradients ({o['fp32_bytes']}): all-reduce bucket.buffer().to(torch.bfloat16), "
                            f"not the buffer itself")
        elif abs(o["ratio"] - 2) < 0.1:
            problems.append(f"rank {rank}: the gradients are twice the mean of both ranks': all_reduce sums; "
                            f"divide by the world size (before or after, as fp16_compress_hook does)")
        elif not o["max_err"] <= ATOL * max(o["scale"], 1e-6):  # (a NaN is never within it)
            problems.append(f"rank {rank}: the gradients differ from the mean of both ranks' by up to "
                            f"{o['max_err']:.3g}, more than bf16's rounding ({ATOL:.0%} of the largest): average "
                            f"the whole bucket, then decompress it back into it")
    return problems[:1]


register(Exercise(
    id="11.2", notebook="11_ddp_on_gpus", title="A bf16 compression hook",
    skills="DDP's comm-hook API: GradBucket.buffer(), an async all_reduce's Future and .then(); "
           "compression halves the bytes, the division by world size stays",
    answer="hook(state, bucket) -> torch.futures.Future holding the averaged fp32 bucket",
    nproc=2, on_rank=on_rank, judge=judge))
