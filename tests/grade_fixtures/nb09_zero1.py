"""09.5: a right ZeRO-1 step and the wrong ones, each with the hint it must get."""
import torch
import torch.distributed as dist


def _update(shard, grad, state, lr, momentum, key="buf"):
    if key not in state:
        state[key] = grad.clone()
    else:
        state[key].mul_(momentum).add_(grad)
    shard.sub_(lr * state[key])


def good(param, grad, state, lr, momentum):
    world, rank = dist.get_world_size(), dist.get_rank()
    shards, grads = torch.tensor_split(param, world), torch.tensor_split(grad, world)
    _update(shards[rank], grads[rank], state, lr, momentum)
    for owner, shard in enumerate(shards):
        dist.broadcast(shard, src=owner)


def no_broadcast(param, grad, state, lr, momentum):
    world, rank = dist.get_world_size(), dist.get_rank()
    _update(torch.tensor_split(param, world)[rank], torch.tensor_split(grad, world)[rank], state, lr, momentum)


def full_state(param, grad, state, lr, momentum):  # right numbers, but every rank keeps all momentum
    world, rank = dist.get_world_size(), dist.get_rank()
    if "buf" not in state:
        state["buf"] = grad.clone()
    else:
        state["buf"].mul_(momentum).add_(grad)
    shards = torch.tensor_split(param, world)
    shards[rank].sub_(lr * torch.tensor_split(state["buf"], world)[rank])
    for owner, shard in enumerate(shards):
        dist.broadcast(shard, src=owner)


def forgets_momentum(param, grad, state, lr, momentum):
    world, rank = dist.get_world_size(), dist.get_rank()
    shards, grads = torch.tensor_split(param, world), torch.tensor_split(grad, world)
    shards[rank].sub_(lr * grads[rank])
    for owner, shard in enumerate(shards):
        dist.broadcast(shard, src=owner)


def in_float64(param, grad, state, lr, momentum):  # momentum kept in float64, the shard stays float32
    world, rank = dist.get_world_size(), dist.get_rank()
    shards, grads = torch.tensor_split(param, world), torch.tensor_split(grad, world)
    _update(shards[rank], grads[rank].double(), state, lr, momentum)
    for owner, shard in enumerate(shards):
        dist.broadcast(shard, src=owner)


PRECISIONS = {"float32": good, "float64": in_float64}


MISTAKES = {
    "forgets to broadcast": (no_broadcast, "still holds the old values of shard(s)"),
    "keeps the whole state": (full_state, "keeps only its own shard's"),
    "no momentum": (forgets_momentum, "differs from SGD with momentum"),
}
