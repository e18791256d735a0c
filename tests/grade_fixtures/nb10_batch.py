"""10.6: a right batch plan and the wrong ones, each with the hint it must get."""
import torch


def good(global_batch, world_size, max_per_rank):
    share = global_batch // world_size
    steps = next(k for k in range(1, share + 1) if share % k == 0 and share // k <= max_per_rank)
    return share // steps, steps


def not_split(global_batch, world_size, max_per_rank):
    return global_batch, 1


def max_then_floor(global_batch, world_size, max_per_rank):
    return max_per_rank, max(1, global_batch // (max_per_rank * world_size))


def one_sample(global_batch, world_size, max_per_rank):
    return 1, global_batch // world_size


def ignores_the_limit(global_batch, world_size, max_per_rank):
    return global_batch // world_size, 1


def _plan_in(dtype):
    def plan(global_batch, world_size, max_per_rank):  # true division: 16.0, exact for whole numbers
        share = torch.tensor(global_batch, dtype=dtype) / world_size
        steps = next(k for k in range(1, int(share) + 1) if share % k == 0 and share / k <= max_per_rank)
        return share / steps, torch.tensor(steps, dtype=dtype)
    return plan


PRECISIONS = {"float32": _plan_in(torch.float32), "float64": _plan_in(torch.float64)}


MISTAKES = {
    "global batch on every rank": (not_split, "each rank takes its share"),
    "largest batch, steps rounded down": (max_then_floor, "must equal the global batch"),
    "one sample per micro-step": (one_sample, "the fewest micro-steps"),
    "does not fit": (ignores_the_limit, "do not fit on a rank"),
}
