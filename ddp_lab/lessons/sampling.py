"""Who reads which sample, and how to count every sample exactly once.

- shard_indices(): what torch's DistributedSampler hands each rank (it is
  called, not re-implemented), so notebooks can draw and check it without a launch.
- exact_shard() + evaluate_distributed(): validation where every sample is
  counted once. DistributedSampler pads the last round by repeating samples so
  that every rank gets the same count; that is right for training (equal step
  counts, no hang) and wrong for metrics (duplicates are counted twice).
- LengthBalancedSampler: for variable-length samples, gives every rank batches
  of similar padded cost at each step, so no rank is the straggler the others wait for.
  sequence_lengths() is the long-tailed workload notebook 02 balances.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, Sampler


class _Sized:
    """DistributedSampler only needs len(dataset)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def shard_indices(n: int, world_size: int, shuffle: bool = False, seed: int = 0,
                  epoch: int = 0, drop_last: bool = False) -> list[list[int]]:
    """Indices each rank gets from DistributedSampler in `epoch` (rank order)."""
    out = []
    for rank in range(world_size):
        s = DistributedSampler(_Sized(n), num_replicas=world_size, rank=rank,
                               shuffle=shuffle, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def exact_shard(n: int, rank: int, world_size: int) -> list[int]:
    """rank, rank + W, rank + 2W, ...: no padding, so shards may differ by one."""
    return list(range(rank, n, world_size))


@torch.no_grad()
def local_sums(model, X, y, indices, batch_size: int = 256) -> torch.Tensor:
    """[loss_sum, correct, count] over X[indices], in float64 so sums add exactly enough."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    idx = torch.as_tensor(list(indices), dtype=torch.long)
    for start in range(0, len(idx), batch_size):
        b = idx[start:start + batch_size]
        logits = model(X[b])
        totals[0] += F.cross_entropy(logits, y[b], reduction="none").double().sum()
        totals[1] += (logits.argmax(1) == y[b]).sum()
        totals[2] += len(b)
    return totals


def evaluate_distributed(model, X, y, batch_size: int = 256) -> dict:
    """Loss and accuracy over the whole set, every sample counted once.

    Each rank evaluates its exact (unpadded) shard, then one all_reduce of
    [loss_sum, correct, count] gives global sums. Every rank must call it; it runs
    exactly one collective whatever the shard sizes, so uneven shards cannot hang.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    totals = local_sums(model, X, y, exact_shard(len(y), rank, world), batch_size)
    if dist.is_initialized():
        dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return {"loss": loss_sum / count, "accuracy": correct / count, "count": int(count)}


SEQS, SEQ_BATCH = 128, 8   # notebook 02's variable-length sequences, and the per-rank batch


def sequence_lengths(n: int = SEQS, seed: int = 0) -> torch.Tensor:
    """Long-tailed lengths (16..512), like sentences: a few long ones dominate a batch's cost."""
    g = torch.Generator().manual_seed(seed)
    return torch.empty(n).log_normal_(4.8, 0.5, generator=g).clamp(16, 512).long()


def padded_cost(lengths, batch) -> int:
    """Cost of a batch padded to its longest sample: batch size x max length."""
    return len(batch) * max(int(lengths[i]) for i in batch) if len(batch) else 0


class LengthBalancedSampler(Sampler):
    """Batch sampler: at every step each rank gets samples of similar length.

    Each epoch: shuffle, sort by length (ties stay random), cut into global
    batches of batch_size * world_size neighbours, deal each global batch to the
    ranks in snake order (0,1,..,W-1,W-1,..,0) so their padded costs match, then
    shuffle the order of the steps. Like DistributedSampler it pads the last
    global batch by repeating samples, so every rank runs the same number of
    steps (uneven step counts hang DDP). The price, as the engineering article warns: a batch
    now holds samples of similar length instead of a random mix.
    Use it as DataLoader(dataset, batch_sampler=LengthBalancedSampler(...)).
    """

    def __init__(self, lengths, batch_size: int, num_replicas: int | None = None,
                 rank: int | None = None, seed: int = 0):
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.lengths = torch.as_tensor(lengths)
        self.batch_size, self.num_replicas, self.rank, self.seed = batch_size, num_replicas, rank, seed
        self.epoch = 0
        self.global_batch = batch_size * num_replicas
        self.num_steps = math.ceil(len(self.lengths) / self.global_batch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_steps

    def global_steps(self) -> list[list[list[int]]]:
        """steps[s][r] = the batch rank r reads at step s (same on every rank)."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g)
        order = order[torch.sort(self.lengths[order], stable=True).indices]
        pad = self.num_steps * self.global_batch - len(order)
        order = torch.cat([order, order[:pad]]).tolist()  # repeat a few, as DistributedSampler does
        W = self.num_replicas
        snake = [r if (k // W) % 2 == 0 else W - 1 - r for k, r in
                 ((k, k % W) for k in range(self.global_batch))]
        steps = []
        for s in range(self.num_steps):
            chunk = order[s * self.global_batch:(s + 1) * self.global_batch]
            steps.append([[i for i, owner in zip(chunk, snake) if owner == r] for r in range(W)])
        step_order = torch.randperm(self.num_steps, generator=g).tolist()
        return [steps[s] for s in step_order]

    def __iter__(self):
        for step in self.global_steps():
            yield step[self.rank]
