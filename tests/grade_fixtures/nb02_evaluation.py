"""02.4: a right distributed accuracy and the wrong ones, each with the hint it must get."""
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler


def _counts(model, dataset, indices):
    x = torch.stack([dataset[i][0] for i in indices])
    y = torch.stack([dataset[i][1] for i in indices])
    return (model(x).argmax(1) == y).sum().item(), len(indices)


def good(model, dataset):
    sampler = DistributedSampler(dataset, shuffle=False)
    mine = [i for n, i in enumerate(sampler) if n * sampler.num_replicas + sampler.rank < len(dataset)]
    t = torch.tensor(_counts(model, dataset, mine), dtype=torch.float64)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def counts_padding(model, dataset):
    t = torch.tensor(_counts(model, dataset, list(DistributedSampler(dataset, shuffle=False))),
                     dtype=torch.float64)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def own_shard_only(model, dataset):
    correct, count = _counts(model, dataset, list(DistributedSampler(dataset, shuffle=False)))
    return correct / count


def mean_of_means(model, dataset):
    sampler = DistributedSampler(dataset, shuffle=False)
    mine = [i for n, i in enumerate(sampler) if n * sampler.num_replicas + sampler.rank < len(dataset)]
    correct, count = _counts(model, dataset, mine)
    acc = torch.tensor([correct / count], dtype=torch.float64)
    dist.all_reduce(acc)
    return (acc / dist.get_world_size()).item()


def _reduced(counts, dtype):
    t = torch.tensor(counts, dtype=dtype)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def in_float32(model, dataset):  # torch's default dtype: 7/11 to within 6e-8
    sampler = DistributedSampler(dataset, shuffle=False)
    mine = [i for n, i in enumerate(sampler) if n * sampler.num_replicas + sampler.rank < len(dataset)]
    return _reduced(_counts(model, dataset, mine), torch.float32)


def counts_padding_float32(model, dataset):
    return _reduced(_counts(model, dataset, list(DistributedSampler(dataset, shuffle=False))), torch.float32)


PRECISIONS = {"float32": in_float32, "float64": good}


MISTAKES = {
    "counts the padding": (counts_padding, "the padding was counted"),
    "own shard only": (own_shard_only, "own shard: all-reduce [correct, count]"),
    "mean of per-rank accuracies": (mean_of_means, "wrong when shards differ in size"),
    "counts the padding, in float32": (counts_padding_float32, "the padding was counted"),
}
