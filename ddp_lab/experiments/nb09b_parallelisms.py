"""Notebook 09b: tensor and pipeline parallelism written by hand, then with torch's API; the PyTorch
side of the survey's TensorFlow/Horovod code. Needs exactly 2 ranks.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb09b_parallelisms

tp_by_hand   a 16 -> 64 -> 16 MLP block split Megatron-style with plain dist.all_reduce: the first
             Linear by output features (ColumnParallelLinear), the second by input features
             (RowParallelLinear); output and gradients compared with the unsplit block
tensor       the same block split by torch.distributed.tensor.parallel (nb09_parallel.tensor_demo)
pp_by_hand   a 4-layer MLP cut in two stages, GPipe over 4 micro-batches with dist.send / dist.recv;
             loss and gradients compared with the whole model on the whole batch
pipeline     the same with torch.distributed.pipelining (nb09_parallel.pipeline_demo)
pair         the PyTorch side of the survey's Horovod calls (nb09_pairs.run_all)
"""
import argparse
import copy
import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ddp_lab.engine import runtime
from ddp_lab.lessons.beyond import Group
from ddp_lab.experiments import nb09_pairs, nb09_parallel
from ddp_lab.experiments.nb09_parallel import BATCH, MICRO, D, H, gloo_ops


def digest(t) -> str:
    return hashlib.blake2b(t.detach().contiguous().numpy().tobytes(), digest_size=8).hexdigest()


# --- Tensor parallelism by hand (Megatron-LM's split, as picotron writes it) -------------------
class CopyToTP(torch.autograd.Function):
    """Entering the split: forward passes x unchanged to every rank; backward all-reduces
    the input's gradient, because each rank computed only its part of it."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Leaving the split: forward all-reduces (adds) the ranks' partial outputs; backward passes
    the gradient unchanged, since every rank's partial output entered the sum once."""
    @staticmethod
    def forward(ctx, partial, group):
        out = partial.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """Rank r keeps rows r*n/N..(r+1)*n/N of W (n = out_features): y_r = x W_r^T + b_r,
    its slice of the output features. torch's name for this split: ColwiseParallel."""
    def __init__(self, full: nn.Linear, rank: int, world: int, group=None):
        super().__init__()
        part = slice(rank * full.out_features // world, (rank + 1) * full.out_features // world)
        self.weight = nn.Parameter(full.weight.detach()[part].clone())
        self.bias = nn.Parameter(full.bias.detach()[part].clone())
        self.group = group

    def forward(self, x):
        return F.linear(CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Rank r keeps columns r*n/N..(r+1)*n/N of W (n = in_features) and gets its slice h_r of
    the input: y = sum_r h_r W_r^T + b, one all-reduce. torch's name: RowwiseParallel."""
    def __init__(self, full: nn.Linear, rank: int, world: int, group=None):
        super().__init__()
        part = slice(rank * full.in_features // world, (rank + 1) * full.in_features // world)
        self.weight = nn.Parameter(full.weight.detach()[:, part].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())   # added once, after the sum
        self.group = group

    def forward(self, h):
        return ReduceFromTP.apply(F.linear(h, self.weight), self.group) + self.bias


def tp_by_hand(grp):
    torch.manual_seed(0)                                       # the block tensor_demo splits, too
    ref = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    block = nn.Sequential(ColumnParallelLinear(ref[0], grp.rank, grp.world_size, grp.pg), nn.ReLU(),
                          RowParallelLinear(ref[2], grp.rank, grp.world_size, grp.pg))
    x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1)).requires_grad_()  # same on all ranks
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = block(x)
        y.square().mean().backward()
    x_grad, x.grad = x.grad, None
    ref(x).square().mean().backward()
    mine = slice(grp.rank * H // grp.world_size, (grp.rank + 1) * H // grp.world_size)
    grp.record(kind="tp_by_hand", shapes={"0.weight": list(block[0].weight.shape), "2.weight": list(block[2].weight.shape)},
               out_diff=float((y - ref(x)).detach().abs().max()), x_grad_diff=float((x_grad - x.grad).abs().max()),
               grad_diff=max(float((block[0].weight.grad - ref[0].weight.grad[mine]).abs().max()),
                             float((block[2].weight.grad - ref[2].weight.grad[:, mine]).abs().max())),
               shard_digests={"0.weight": digest(block[0].weight), "2.weight": digest(block[2].weight)},
               gloo_ops=gloo_ops(prof))


# --- Pipeline parallelism by hand: GPipe on 2 stages with send / recv ----------------------------
def gpipe_by_hand(grp, micro: int = MICRO):
    torch.manual_seed(0)                                       # the model pipeline_demo cuts, too
    ref = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, D))
    first, last = grp.rank == 0, grp.rank == grp.world_size - 1
    stage = copy.deepcopy(ref[:2] if first else ref[2:])       # rank 0: layers 0-1, rank 1: layers 2-4
    peer = lambda r: dist.get_global_rank(grp.pg, r) if grp.pg is not None else r
    g = torch.Generator().manual_seed(2)
    x, target = torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)
    inputs, outputs, losses = [], [], []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for xm, tm in zip(x.chunk(micro), target.chunk(micro)):       # GPipe: every forward first
            if first:
                inp = xm
            else:
                inp = torch.empty(len(xm), H)
                dist.recv(inp, src=peer(grp.rank - 1), group=grp.pg)  # the activation of stage r-1
                inp.requires_grad_()
            out = stage(inp)
            if last:
                loss = F.mse_loss(out, tm)
                losses.append(loss.item())
                out = loss / micro                                    # the mean over the whole batch
            else:
                dist.send(out.detach(), dst=peer(grp.rank + 1), group=grp.pg)
            inputs.append(inp)
            outputs.append(out)
        for inp, out in zip(inputs, outputs):                         # then every backward
            if last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, src=peer(grp.rank + 1), group=grp.pg)  # d loss / d (my output)
                out.backward(grad)
            if not first:
                dist.send(inp.grad, dst=peer(grp.rank - 1), group=grp.pg)
    ref_loss = F.mse_loss(ref(x), target)
    ref_loss.backward()
    ref_params = list((ref[:2] if first else ref[2:]).parameters())
    grp.record(kind="pp_by_hand", micro=micro, losses=losses, ref_loss=float(ref_loss),
               grad_diff=max(float((p.grad - q.grad).abs().max()) for p, q in zip(stage.parameters(), ref_params)),
               gloo_ops=gloo_ops(prof))


def run_all(grp):
    tp_by_hand(grp)
    nb09_parallel.tensor_demo(grp)
    if grp.world_size == 2:
        gpipe_by_hand(grp)
        nb09_parallel.pipeline_demo(grp)
    nb09_pairs.run_all(grp)
    dist.barrier(group=grp.pg)


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    os.environ.setdefault(runtime.BACKEND_ENV, "gloo")  # CPU tensors, counted on CPU: GPUs or not
    with runtime.distributed() as ctx:
        run_all(Group.of(ctx))


if __name__ == "__main__":
    main()
