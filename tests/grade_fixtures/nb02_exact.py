"""02.5: a right exact sampler and the wrong ones, each with the hint it must get."""
import torch
from torch.utils.data import DistributedSampler


def good(n, rank, world_size, shuffle, seed, epoch):
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        order = list(range(n))
    return order[rank::world_size]


def padded(n, rank, world_size, shuffle, seed, epoch):
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def seeded_by_rank(n, rank, world_size, shuffle, seed, epoch):
    return good(n, rank, world_size, shuffle, seed + 1000 * rank, epoch)


def same_every_epoch(n, rank, world_size, shuffle, seed, epoch):
    return good(n, rank, world_size, shuffle, seed, 0)


def tail_dropped(n, rank, world_size, shuffle, seed, epoch):
    return good(n - n % world_size, rank, world_size, shuffle, seed, epoch)


MISTAKES = {
    "padded like DistributedSampler": (padded, "that is DistributedSampler's padding"),
    "a permutation per rank": (seeded_by_rank, "every rank must draw the same permutation"),
    "no epoch in the seed": (same_every_epoch, "mix the epoch into the seed"),
    "tail dropped": (tail_dropped, "never read"),
}
