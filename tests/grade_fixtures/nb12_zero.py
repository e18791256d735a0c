"""12.3: a right sharded Adam and the wrong ones, each with the hint it must get."""
import torch
import torch.distributed as dist

EID = "12.3"


class ShardedAdam:
    """Whole parameters dealt to ranks by size (as ZeroRedundancyOptimizer does); Adam on the own
    ones; every parameter broadcast from its owner after the step."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, dtype=None):
        self.lr, self.betas, self.eps, self.dtype, self.t = lr, betas, eps, dtype, 0
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.owner, load = {}, [0] * world
        self.params = list(params)
        for i in sorted(range(len(self.params)), key=lambda i: -self.params[i].numel()):
            r = load.index(min(load))
            self.owner[i], load[r] = r, load[r] + self.params[i].numel()
        self.state = {i: {"exp_avg": torch.zeros_like(p, dtype=dtype or p.dtype),
                          "exp_avg_sq": torch.zeros_like(p, dtype=dtype or p.dtype)}
                      for i, p in enumerate(self.params) if self.owner[i] == self.rank}

    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2 = self.betas
        for i, s in self.state.items():
            p = self.params[i]
            g = p.grad.to(s["exp_avg"].dtype)
            s["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
            s["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            m_hat = s["exp_avg"] / (1 - b1 ** self.t)
            v_hat = s["exp_avg_sq"] / (1 - b2 ** self.t)
            p.sub_((self.lr * m_hat / (v_hat.sqrt() + self.eps)).to(p.dtype))
        self._share()

    def _share(self):
        for i, p in enumerate(self.params):
            dist.broadcast(p.data, src=self.owner[i])


good = ShardedAdam


class InFloat64(ShardedAdam):
    def __init__(self, params, lr):
        super().__init__(params, lr, dtype=torch.float64)


PRECISIONS = {"float32": ShardedAdam, "float64": InFloat64}


class NoBroadcast(ShardedAdam):
    def _share(self):
        pass


class FullState(ShardedAdam):  # every rank keeps the moments of every parameter
    def __init__(self, params, lr):
        super().__init__(params, lr)
        self.state = {i: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                      for i, p in enumerate(self.params)}

    @torch.no_grad()
    def step(self):
        own = {i: s for i, s in self.state.items() if self.owner[i] == self.rank}
        full, self.state = self.state, own
        super().step()
        self.state = full


class NoBiasCorrection(ShardedAdam):
    @torch.no_grad()
    def step(self):
        self.t = 10 ** 9  # (1 - beta ** t) == 1: the correction is gone
        super().step()


class ZeroInside:
    def __init__(self, params, lr):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        self.inner = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=lr)
        self.state = self.inner.optim.state

    def step(self):
        self.inner.step()


class NaNStep(ShardedAdam):
    @torch.no_grad()
    def step(self):
        super().step()
        for p in self.params:
            p.mul_(float("nan"))


class Lopsided(ShardedAdam):  # rank 0 keeps all but the last parameter's state
    def __init__(self, params, lr):
        super().__init__(params, lr)
        last = len(self.params) - 1
        self.owner = {i: 1 if i == last else 0 for i in range(len(self.params))}
        self.state = {i: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                      for i, p in enumerate(self.params) if self.owner[i] == self.rank}


class AveragesAgain(ShardedAdam):  # all-reduces gradients DDP already averaged
    @torch.no_grad()
    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        super().step()


MISTAKES = {
    "forgets to broadcast": (NoBroadcast, "still holds the old values of"),
    "keeps the whole state": (FullState, "each moment element belongs to one rank only"),
    "no bias correction": (NoBiasCorrection, "Adam's bias correction"),
    "hands it to ZeroRedundancyOptimizer": (ZeroInside, "refused: your answer hands the work to torch.distributed.optim"),
    "NaN parameters": (NaNStep, "hold NaN or inf"),
    "a lopsided deal": (Lopsided, "deal the largest parameters first"),
    "averages the gradients again": (AveragesAgain, "the gradients arrive already averaged"),
}
