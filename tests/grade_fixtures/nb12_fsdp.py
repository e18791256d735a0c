"""12.5: a right FSDP in miniature and the wrong ones, each with the hint it must get."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

EID = "12.5"


def gather(share, numel):
    """Every rank's share, in rank order, trimmed of the padding: the layer's flat parameters."""
    parts = [torch.empty_like(share) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, share.contiguous())
    return torch.cat(parts)[:numel]


class ShardedLinearFn(torch.autograd.Function):
    """Forward gathers the layer and frees it; backward gathers it again, then keeps its share of
    the mean gradient (all-reduce and slice: gloo's stand-in for reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, share, out_f, in_f, divide):
        flat = gather(share.detach(), out_f * in_f + out_f)
        w, b = flat[:out_f * in_f].view(out_f, in_f), flat[out_f * in_f:]
        ctx.save_for_backward(x, share)
        ctx.shape, ctx.divide = (out_f, in_f), divide
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, share = ctx.saved_tensors
        out_f, in_f = ctx.shape
        flat = gather(share, out_f * in_f + out_f)
        w = flat[:out_f * in_f].view(out_f, in_f)
        full = torch.cat([(dy.t() @ x).flatten(), dy.sum(0)])
        full = torch.cat([full, full.new_zeros(share.numel() * dist.get_world_size() - full.numel())])
        dist.all_reduce(full)
        if ctx.divide:
            full /= dist.get_world_size()
        rank = dist.get_rank()
        return dy @ w, full[rank * share.numel():(rank + 1) * share.numel()], None, None, None


class ShardedLinear(nn.Module):
    DIVIDE = True

    def __init__(self, linear):
        super().__init__()
        world, rank = dist.get_world_size(), dist.get_rank()
        self.out_f, self.in_f = linear.weight.shape
        flat = torch.cat([linear.weight.detach().flatten(), linear.bias.detach()])
        size = -(-flat.numel() // world)
        flat = torch.cat([flat, flat.new_zeros(size * world - flat.numel())])
        self.share = nn.Parameter(flat[rank * size:(rank + 1) * size].clone())

    def forward(self, x):
        return ShardedLinearFn.apply(x, self.share, self.out_f, self.in_f, self.DIVIDE)


class MiniFSDP(nn.Module):
    LAYER = ShardedLinear

    def __init__(self, module):
        super().__init__()
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, self.LAYER(child))
        self.module = module

    def forward(self, x):
        return self.module(x)


good = MiniFSDP


class _NoDivide(ShardedLinear):
    DIVIDE = False


class NoDivision(MiniFSDP):
    LAYER = _NoDivide


class _KeepsWhole(ShardedLinear):  # autograd keeps the gathered weight until backward
    def forward(self, x):
        flat = _GatherFn.apply(self.share, self.out_f * self.in_f + self.out_f)
        return F.linear(x, flat[:self.out_f * self.in_f].view(self.out_f, self.in_f), flat[self.out_f * self.in_f:])


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, share, numel):
        ctx.size = share.numel()
        return gather(share, numel)

    @staticmethod
    def backward(ctx, grad):
        world, rank = dist.get_world_size(), dist.get_rank()
        full = torch.cat([grad, grad.new_zeros(ctx.size * world - grad.numel())])
        dist.all_reduce(full)
        return full[rank * ctx.size:(rank + 1) * ctx.size] / world, None


class KeepsWhole(MiniFSDP):
    LAYER = _KeepsWhole


class Replicated(MiniFSDP):  # no sharding at all: every rank keeps every layer
    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(_average)


def _average(p):
    dist.all_reduce(p.grad)
    p.grad /= dist.get_world_size()


class TorchInside(nn.Module):
    def __init__(self, module):
        super().__init__()
        from torch.distributed.fsdp import fully_shard
        for m in module.modules():
            if isinstance(m, nn.Linear):
                fully_shard(m)
        self.module = fully_shard(module)

    def forward(self, x):
        return self.module(x)


class _InFloat64(ShardedLinear):  # gathers, multiplies and reduces in float64
    def forward(self, x):
        return ShardedLinearFn.apply(x.double(), self.share.double(), self.out_f, self.in_f, True).float()


class InFloat64(MiniFSDP):
    LAYER = _InFloat64


class _NaNLayer(ShardedLinear):
    def forward(self, x):
        return super().forward(x) * float("nan")


class NaNOutputs(MiniFSDP):
    LAYER = _NaNLayer


PRECISIONS = {"float32": MiniFSDP, "float64": InFloat64}


MISTAKES = {
    "forgets the division": (NoDivision, "2x FSDP2's: the reduce sums"),
    "keeps the gathered weight for backward": (KeepsWhole, "autograd kept whole layers"),
    "keeps every layer whole": (Replicated, "keep only this rank's share as a Parameter"),
    "hands it to FSDP2": (TorchInside, "refused: your answer hands the work to FSDP2's fully_shard"),
    "NaN outputs": (NaNOutputs, "is NaN or inf"),
}
