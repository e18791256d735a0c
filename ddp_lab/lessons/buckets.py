"""Data parallel by hand, twice: the naive way, then bucketed with gradient hooks (DDP's idea).

    loss.backward(); all_reduce_grads(model)           # 1. one all-reduce per tensor, after backward

    dp = BucketedDP(model, bucket_cap_mb=25)           # 2. buckets fire *during* backward
    loss.backward(); dp.finish()                       #    wait, unflatten, average

Why buckets: one all-reduce per tensor pays the latency alpha per tensor; one for
the whole model can only start after backward ends. Buckets of ~25 MB start
communicating as soon as their last gradient exists, overlapping the rest of
backward. Gradients appear in roughly reverse parameter order, so buckets are
filled from the last parameter to the first. DDP keeps the first bucket small
(1 MB) so the first all-reduce starts early: `assign` mirrors that rule.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.lessons import models

MB = 1024 * 1024  # DDP's bucket_cap_mb is in MiB


def deep_mlp(width: int = 512, depth: int = 28, in_features: int = 64, classes: int = 10) -> nn.Module:
    """Many equal ~1 MB layers, so bucket boundaries fall where the caps say, not where
    one giant tensor forces them (a bucket never splits a tensor)."""
    return models.wide_mlp(width=width, depth=depth, in_features=in_features, classes=classes)


def assign(sizes_bytes, cap_bytes: int, first_cap_bytes: int | None = None) -> list:
    """Bucket the tensors (given in parameter order) as DDP does: walk them in reverse,
    close a bucket once it holds at least its cap. Returns lists of parameter indices,
    first bucket first (= the one whose gradients are ready first)."""
    caps = iter([first_cap_bytes or cap_bytes])
    cap = next(caps)
    buckets, current, size = [], [], 0
    for i in reversed(range(len(sizes_bytes))):
        current.append(i)
        size += sizes_bytes[i]
        if size >= cap:
            buckets.append(current)
            current, size, cap = [], 0, cap_bytes
    if current:
        buckets.append(current)
    return buckets


def all_reduce_grads(model: nn.Module) -> int:
    """The naive way: after backward, average every gradient, one blocking call each."""
    world = dist.get_world_size()
    calls = 0
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
            calls += 1
    return calls


class BucketedDP:
    """Hand-written bucketed data parallel, driven by post-accumulate-grad hooks."""

    def __init__(self, model: nn.Module, bucket_cap_mb: float = 25, first_bucket_mb: float | None = 1):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Same starting point everywhere: copy rank 0's weights (DDP does this too).
        for p in self.params:
            dist.broadcast(p.data, src=0)
        sizes = [p.numel() * p.element_size() for p in self.params]
        first = int(first_bucket_mb * MB) if first_bucket_mb else None
        self.buckets = assign(sizes, int(bucket_cap_mb * MB), first)
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._reset()
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook(i))

    def _reset(self):
        self.pending = [len(b) for b in self.buckets]
        self.works: list = []

    def _hook(self, i):
        def hook(param):
            b = self.bucket_of[i]
            self.pending[b] -= 1
            if self.pending[b] == 0:  # NEW: the bucket's last gradient just arrived: send it now
                flat = torch.cat([self.params[j].grad.reshape(-1) for j in self.buckets[b]])
                self.works.append((b, flat, dist.all_reduce(flat, async_op=True)))
        return hook

    def finish(self) -> None:
        """Call after backward: wait for every bucket, write the averages back."""
        world = dist.get_world_size()
        if any(self.pending):
            raise RuntimeError("finish() before every gradient arrived: did backward run on all parameters?")
        for b, flat, work in self.works:
            work.wait()
            flat.div_(world)
            offset = 0
            for j in self.buckets[b]:
                g = self.params[j].grad
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._reset()


def recording_hook(log: list):
    """A DDP comm hook that does what the default one does (average by all-reduce) and
    notes, per bucket, its index, size and when its all-reduce started and finished."""
    def hook(state, bucket):
        buf = bucket.buffer()
        rec = {"index": bucket.index(), "numel": buf.numel(), "bytes": buf.numel() * buf.element_size(),
               "n_params": len(bucket.parameters()), "t_start": time.perf_counter()}
        log.append(rec)
        buf.div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f):
            rec["t_end"] = time.perf_counter()
            return f.value()[0]
        return fut.then(done)
    return hook


class CountingAllReduce:
    """Context manager: count the bytes every dist.all_reduce call is handed (on this rank).
    Comm hooks look the function up at call time, so patching it sees what they send."""

    def __enter__(self):
        self.bytes, self.calls, self._orig = 0, 0, dist.all_reduce

        def counting(tensor, *a, **k):
            self.bytes += tensor.numel() * tensor.element_size()
            self.calls += 1
            return self._orig(tensor, *a, **k)
        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig
        return False
