"""12.1: a right DDP of your own and the wrong ones, each with the hint it must get."""
import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.lessons.build import plan_buckets


class MyDDP(nn.Module):
    """Broadcast the start; one flat buffer per bucket, all-reduced as soon as its last gradient is
    ready; finish() waits, divides and copies back; no_sync() switches the hooks off."""

    def __init__(self, module, bucket_cap_bytes, dtype=None):
        super().__init__()
        self.module, self.sync, self.dtype = module, True, dtype
        if self.BROADCAST:
            for p in module.parameters():
                dist.broadcast(p.data, src=0)
        self.buckets = self._plan(list(module.parameters()), bucket_cap_bytes)
        self.pending, self.ready = [], [0] * len(self.buckets)
        for b, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, b=b: self._ready(b))

    BROADCAST = True

    def _plan(self, params, cap):
        return plan_buckets(params, cap)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _ready(self, b):
        if not self.sync:
            return
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):
            flat = torch.cat([p.grad.flatten() for p in self.buckets[b]])
            if self.dtype is not None:
                flat = flat.to(self.dtype)
            self.pending.append((b, flat, self._issue(flat)))

    def _issue(self, flat):
        return dist.all_reduce(flat, async_op=True)

    def finish(self):
        for b, flat, work in self.pending:
            work.wait()
            self._unpack(b, flat / dist.get_world_size())
        self.pending, self.ready = [], [0] * len(self.buckets)

    def _unpack(self, b, flat):
        offset = 0
        for p in self.buckets[b]:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


good = MyDDP


class InFloat64(MyDDP):  # sums the buckets in float64, copies float32 back
    def __init__(self, module, cap):
        super().__init__(module, cap, dtype=torch.float64)


PRECISIONS = {"float32": MyDDP, "float64": InFloat64}


class PerParameter(MyDDP):
    def __init__(self, module, cap):
        super().__init__(module, cap_bytes_one_each(module))


def cap_bytes_one_each(module):
    return 1  # every parameter closes its own bucket


class WaitsInHook(MyDDP):
    def _issue(self, flat):
        work = dist.all_reduce(flat, async_op=True)
        work.wait()
        return work


class UnpacksBeforeWait(MyDDP):
    def finish(self):
        for b, flat, work in self.pending:
            self._unpack(b, flat / dist.get_world_size())
            work.wait()
        self.pending, self.ready = [], [0] * len(self.buckets)


class NoDivision(MyDDP):
    def finish(self):
        for b, flat, work in self.pending:
            work.wait()
            self._unpack(b, flat)
        self.pending, self.ready = [], [0] * len(self.buckets)


class ForwardOrder(MyDDP):
    def _plan(self, params, cap):
        return plan_buckets(params[::-1], cap)


class NoBroadcast(MyDDP):
    BROADCAST = False


class AfterBackward(MyDDP):  # all-reduces every bucket in finish(): right numbers, no overlap
    def _ready(self, b):
        if self.sync:
            self.ready[b] += 1

    def finish(self):
        for b, bucket in enumerate(self.buckets):
            flat = torch.cat([p.grad.flatten() for p in bucket])
            dist.all_reduce(flat, async_op=True).wait()
            self._unpack(b, flat / dist.get_world_size())
        self.ready = [0] * len(self.buckets)


class SyncsInNoSync(MyDDP):
    @contextlib.contextmanager
    def no_sync(self):
        yield


class TorchInside(nn.Module):
    def __init__(self, module, cap):
        super().__init__()
        self.inner = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=cap / 2**20)

    def forward(self, *args):
        return self.inner(*args)

    def finish(self):
        pass

    def no_sync(self):
        return self.inner.no_sync()


class NaNGradients(MyDDP):
    def _unpack(self, b, flat):
        super()._unpack(b, flat * float("nan"))


class IgnoresCap(MyDDP):
    def __init__(self, module, cap):
        super().__init__(module, 4096)  # plan_buckets' default, whatever the grader asks


class NeverWaits(MyDDP):
    def finish(self):
        for b, flat, work in self.pending:
            self._unpack(b, flat / dist.get_world_size())
        self.pending, self.ready = [], [0] * len(self.buckets)


MISTAKES = {
    "all-reduces every parameter": (PerParameter, "one all-reduce per parameter"),
    "waits inside the hook": (WaitsInHook, "waited for an all-reduce inside backward"),
    "unpacks before the wait": (UnpacksBeforeWait, "is this rank's own gradient, not the average"),
    "forgets the division": (NoDivision, "divide each bucket by the world size"),
    "buckets in forward order": (ForwardOrder, "fill buckets in reverse"),
    "no broadcast": (NoBroadcast, "broadcast every parameter from rank 0"),
    "all-reduces after backward": (AfterBackward, "after backward returned: nothing overlaps"),
    "all-reduces inside no_sync": (SyncsInNoSync, "inside no_sync()"),
    "hands it to torch's DDP": (TorchInside, "refused: your answer hands the work to torch.nn.parallel"),
    "NaN gradients": (NaNGradients, "hold NaN or inf"),
    "ignores bucket_cap_bytes": (IgnoresCap, "closed at the bucket_cap_bytes your class is given"),
    "never waits": (NeverWaits, "never called wait() on 4 of its all-reduce handles"),
}
EID = "12.1"
