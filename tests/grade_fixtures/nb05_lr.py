"""05.5: a right learning rate and the wrong ones, each with the hint it must get."""
import math

import torch


def good(base_lr, base_batch, per_rank_batch, world_size, k, optimizer):
    growth = per_rank_batch * world_size * k / base_batch
    return base_lr * (growth if optimizer == "sgd" else math.sqrt(growth))


def ignores_k(base_lr, base_batch, per_rank_batch, world_size, k, optimizer):
    return good(base_lr, base_batch, per_rank_batch, world_size, 1, optimizer)


def linear_always(base_lr, base_batch, per_rank_batch, world_size, k, optimizer):
    return good(base_lr, base_batch, per_rank_batch, world_size, k, "sgd")


def sqrt_always(base_lr, base_batch, per_rank_batch, world_size, k, optimizer):
    return good(base_lr, base_batch, per_rank_batch, world_size, k, "adamw")


def times_ranks(base_lr, base_batch, per_rank_batch, world_size, k, optimizer):
    growth = world_size * k
    return base_lr * (growth if optimizer == "sgd" else math.sqrt(growth))


def in_float32(base_lr, base_batch, per_rank_batch, world_size, k, optimizer):
    growth = torch.tensor(per_rank_batch * world_size * k / base_batch, dtype=torch.float32)
    return torch.tensor(base_lr, dtype=torch.float32) * (growth if optimizer == "sgd" else growth.sqrt())


def linear_always_float32(base_lr, base_batch, per_rank_batch, world_size, k, optimizer):
    return in_float32(base_lr, base_batch, per_rank_batch, world_size, k, "sgd")


PRECISIONS = {"float32": in_float32, "float64": good}


MISTAKES = {
    "K forgotten": (ignores_k, "counts the micro-steps too"),
    "linear for Adam": (linear_always, "square root of the batch's growth"),
    "square root for SGD": (sqrt_always, "plain SGD scales linearly"),
    "lr x ranks x K": (times_ranks, "relative to the batch the learning rate was tuned for"),
    "linear for AdamW, in float32": (linear_always_float32, "not linearly"),
}
