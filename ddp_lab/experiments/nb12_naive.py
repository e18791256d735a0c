"""DDP written the naive way, beside torch's, on the same data (notebook 12's first launch).

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb12_naive

The naive way: broadcast rank 0's weights once; after each backward, all-reduce every gradient on
its own and divide by the world size. Each rank records, per step, how many all-reduces that took,
how far its gradients are from torch's DDP on the same model and data, and the order in which
backward made the gradients (a post-accumulate-grad hook on each parameter).
"""
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.engine import runtime
from ddp_lab.lessons.build import Net, plan_buckets, ready_order

STEPS = 3


def naive_ddp_step(model, loss, world_size) -> int:
    """backward, then one blocking all-reduce per gradient: right, and nothing overlaps."""
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
    return len(list(model.parameters()))  # all-reduces this step


def run(ctx):
    torch.manual_seed(12 + ctx.rank)  # other weights per rank, on purpose: the broadcast fixes that  # ddp-lab: ignore[DDP006]
    model = Net()
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    reference = DDP(copy.deepcopy(model))
    g = torch.Generator().manual_seed(1200 + ctx.rank)
    for step in range(STEPS):
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        calls = naive_ddp_step(model, F.cross_entropy(model(x), y), ctx.world_size)
        F.cross_entropy(reference(x), y).backward()
        diff = max((p.grad - q.grad).abs().max().item()
                   for p, q in zip(model.parameters(), reference.module.parameters()))
        ctx.record(kind="step", step=step, all_reduces=calls, max_diff=diff,
                   largest=max(q.grad.abs().max().item() for q in reference.module.parameters()))
    name = {id(p): n for n, p in model.named_parameters()}
    ctx.record(kind="ready_order", names=ready_order(copy.deepcopy(model), x),
               forward=[n for n, _ in model.named_parameters()],
               buckets=[[name[id(p)] for p in b] for b in plan_buckets(model.parameters())])
    ctx.print0(f"naive DDP: {calls} all-reduces a step, gradients within {diff:.1e} of torch's DDP")


def main() -> None:
    with runtime.distributed() as ctx:
        run(ctx)


if __name__ == "__main__":
    main()
