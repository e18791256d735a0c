"""12.4: a right SyncBatchNorm and the wrong ones, each with the hint it must get."""
import torch
import torch.distributed as dist
from torch import nn

EID = "12.4"


class _SyncBNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, dtype):
        xd = x.to(dtype)
        stats = torch.cat([xd.sum(0), (xd * xd).sum(0), xd.new_tensor([x.shape[0]])])
        dist.all_reduce(stats)  # the one collective of forward: sums, sums of squares, count
        c = x.shape[1]
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean
        invstd = torch.rsqrt(var + eps)
        x_hat = (xd - mean) * invstd
        ctx.save_for_backward(x_hat, weight, invstd)
        ctx.n = n
        return (x_hat * weight.to(dtype) + bias.to(dtype)).to(x.dtype), mean.detach(), var.detach(), n

    @staticmethod
    def backward(ctx, dy, _mean, _var, _n):
        x_hat, weight, invstd = ctx.saved_tensors
        dyd = dy.to(x_hat.dtype)
        local = torch.cat([dyd.sum(0), (dyd * x_hat).sum(0)])
        sums = local.clone()
        dist.all_reduce(sums)  # the one collective of backward: sums of dy and dy * x_hat
        c = dy.shape[1]
        mean_dy, mean_dy_xhat = sums[:c] / ctx.n, sums[c:] / ctx.n
        dx = weight.to(x_hat.dtype) * invstd * (dyd - mean_dy - x_hat * mean_dy_xhat)
        return dx.to(dy.dtype), local[c:].to(weight.dtype), local[:c].to(weight.dtype), None, None


class SyncBN(nn.Module):
    DTYPE = torch.float32

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x):
        y, mean, var, n = _SyncBNFunction.apply(x, self.weight, self.bias, self.eps, self.DTYPE)
        with torch.no_grad():
            self._update(mean, var, n)
        return y

    def _update(self, mean, var, n):
        m = self.momentum
        self.running_mean.mul_(1 - m).add_(m * mean.to(self.running_mean.dtype))
        self.running_var.mul_(1 - m).add_(m * (var * n / (n - 1)).to(self.running_var.dtype))


good = SyncBN


class InFloat64(SyncBN):
    DTYPE = torch.float64


PRECISIONS = {"float32": SyncBN, "float64": InFloat64}


class LocalStats(nn.BatchNorm1d):  # plain BatchNorm: each rank's own statistics
    pass


class TwoInForward(SyncBN):
    def forward(self, x):
        mean = x.detach().sum(0)
        dist.all_reduce(mean)  # a first collective, then the real one below
        return super().forward(x)


class NoBackwardSync(SyncBN):  # statistics all-reduced under autograd's eyes: dist.all_reduce has no gradient
    def forward(self, x):
        stats = torch.cat([x.sum(0), (x * x).sum(0), x.new_tensor([x.shape[0]])]).detach()
        dist.all_reduce(stats)
        c, n = x.shape[1], stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean
        with torch.no_grad():
            self._update(mean, var, n)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class MeanOfMeans(SyncBN):
    def forward(self, x):
        world = dist.get_world_size()
        stats = torch.cat([x.mean(0), (x * x).mean(0)]).detach()
        dist.all_reduce(stats)
        stats /= world
        c = x.shape[1]
        mean, var = stats[:c], stats[c:] - stats[:c] ** 2
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class BiasedRunningVar(SyncBN):
    def _update(self, mean, var, n):
        m = self.momentum
        self.running_mean.mul_(1 - m).add_(m * mean)
        self.running_var.mul_(1 - m).add_(m * var)


class NaNOutput(SyncBN):
    def forward(self, x):
        return super().forward(x) * float("nan")


class TorchSyncBN(nn.SyncBatchNorm):
    pass


MISTAKES = {
    "each rank's own statistics": (LocalStats, "made 0 collectives in forward"),
    "two collectives in forward": (TwoInForward, "made 2 collectives in forward"),
    "no all-reduce in backward": (NoBackwardSync, "made 0 collectives in backward"),
    "a mean of the ranks' means": (MeanOfMeans, "a mean of the ranks' means is not the global mean"),
    "biased running variance": (BiasedRunningVar, "the unbiased variance"),
    "hands it to torch's SyncBatchNorm": (TorchSyncBN, "refused: your answer hands the work to torch.nn.SyncBatchNorm"),
    "NaN outputs": (NaNOutput, "hold NaN or inf"),
}
