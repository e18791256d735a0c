"""Notebooks 09 and 09b: what runs on CPU over gloo; tensor parallelism and a two-stage pipeline.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb09_parallel

tensor    an MLP block split Megatron-style with torch.distributed.tensor.parallel: the first
          Linear by columns (output features), the second by rows (input features). Every rank
          gets the same input; the output and the gradients are compared with the unsplit block.
pipeline  a 4-layer MLP cut in two stages with torch.distributed.pipelining (rank 0: layers 0-1,
          rank 1: layers 2-3), GPipe schedule over 4 micro-batches; the loss and gradients are
          compared with the whole model on the whole batch. Needs exactly 2 ranks.
Records kind="tensor" and kind="pipeline" with the largest differences found (notebook 09b runs both
from nb09b_parallelisms), and kind="cpu_support": which FSDP2/ZeRO options run on CPU over gloo in
this torch, the error when one does not (notebook 09 runs it from nb09_strategies).
"""
import argparse
import copy
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ddp_lab.engine import runtime
from ddp_lab.lessons.beyond import Group

D, H, BATCH, MICRO = 16, 64, 8, 4


def gloo_ops(prof) -> dict:
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("gloo:")}


def tensor_demo(grp):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    block = copy.deepcopy(ref)
    mesh = grp.mesh()
    parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1))  # the same on every rank
    x.requires_grad_(True)  # as if a layer came before: its gradient needs the second all-reduce
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = block(x)
        y.square().mean().backward()
    ref(x).square().mean().backward()
    w0, w2 = block[0].weight, block[2].weight
    rows = H // grp.world_size  # this rank's slice of the hidden features
    mine = slice(grp.rank * rows, (grp.rank + 1) * rows)
    grp.record(kind="tensor",
               shapes={"0.weight": list(w0.to_local().shape), "2.weight": list(w2.to_local().shape)},
               full_shapes={"0.weight": list(ref[0].weight.shape), "2.weight": list(ref[2].weight.shape)},
               out_diff=float((y.detach() - ref(x).detach()).abs().max()),
               grad_diff=max(float((w0.grad.to_local() - ref[0].weight.grad[mine]).abs().max()),
                             float((w2.grad.to_local() - ref[2].weight.grad[:, mine]).abs().max())),
               placements={"0.weight": str(w0.placements), "2.weight": str(w2.placements),
                           "2.bias": str(block[2].bias.placements)},
               shard_digests={n: hashlib.blake2b(w.to_local().detach().contiguous().numpy().tobytes(),
                                                 digest_size=8).hexdigest() for n, w in (("0.weight", w0), ("2.weight", w2))},
               gloo_ops=gloo_ops(prof))


def pipeline_demo(grp):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, D))
    whole = copy.deepcopy(ref)
    layers = list(whole[:2]) if grp.rank == 0 else list(whole[2:])
    stage = PipelineStage(nn.Sequential(*layers), grp.rank, grp.world_size, grp.device, group=grp.pg)
    loss_fn = nn.MSELoss()
    schedule = ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(2)
    x, target = torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)
    losses = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if grp.rank == 0:
            schedule.step(x)                       # the first stage feeds the inputs
        else:
            schedule.step(target=target, losses=losses)  # the last one computes the loss
    ref_loss = loss_fn(ref(x), target)
    ref_loss.backward()
    ref_params = list(ref[:2].parameters()) if grp.rank == 0 else list(ref[2:].parameters())
    grad_diff = max(float((p.grad - q.grad).abs().max()) for p, q in zip(stage.submod.parameters(), ref_params))
    grp.record(kind="pipeline", layers=len(layers), micro=MICRO,
               losses=[float(l) for l in losses], ref_loss=float(ref_loss), grad_diff=grad_diff,
               gloo_ops=gloo_ops(prof))


def local_dtype(p):
    return (p.to_local() if hasattr(p, "to_local") else p).dtype


def cpu_support(grp):
    """What of torch's sharding toolbox runs on CPU/gloo in this torch: the error, or None."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    mesh = grp.mesh()
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    def mixed_precision():
        block = fully_shard(nn.Linear(D, D), mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        out = block(torch.randn(2, D))
        out.float().sum().backward()
        return f"computes in {out.dtype}, keeps {local_dtype(block.weight)} parameter shards"

    def cpu_offload():
        block = fully_shard(nn.Linear(D, D), mesh=mesh, offload_policy=CPUOffloadPolicy())
        block(torch.randn(2, D)).sum().backward()

    def zero_overlap():
        from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        model = DDP(nn.Linear(D, D), process_group=grp.pg)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                       overlap_with_ddp=True, process_group=grp.pg)
        model.register_comm_hook(grp.pg, hook_with_zero_step(allreduce_hook, model, zero))
        for _ in range(3):  # the overlap starts after DDP has built its buckets
            model(torch.randn(2, D)).sum().backward()

    for name, probe in (("FSDP2 MixedPrecisionPolicy(bf16)", mixed_precision),
                        ("FSDP2 CPUOffloadPolicy", cpu_offload),
                        ("ZeroRedundancyOptimizer(overlap_with_ddp=True)", zero_overlap)):
        try:
            note, error = probe(), None
        except Exception as e:  # noqa: BLE001 - recording what fails is the point
            note, error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        grp.record(kind="cpu_support", name=name, note=note, error=error)


def run_all(grp):
    """Every demo on the ranks of grp (a ddp_lab.lessons.beyond.Group: a job of its own inside a launch)."""
    tensor_demo(grp)
    cpu_support(grp)
    if grp.world_size == 2:
        pipeline_demo(grp)
    dist.barrier(group=grp.pg)


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    os.environ.setdefault(runtime.BACKEND_ENV, "gloo")  # CPU tensors, counted on CPU: GPUs or not
    with runtime.distributed() as ctx:
        run_all(Group.of(ctx))


if __name__ == "__main__":
    main()
