"""05.4: a right accumulation loop and the wrong ones, each with the hint it must get."""
import contextlib

import torch.distributed as dist
import torch.nn.functional as F


def good(model, optimizer, micro_batches):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        sync = i == k - 1
        with contextlib.nullcontext() if sync else model.no_sync():
            (F.mse_loss(model(x), y) / k).backward()
    optimizer.step()
    optimizer.zero_grad()


def no_sync_around_backward_only(model, optimizer, micro_batches):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        loss = F.mse_loss(model(x), y) / k
        if i < k - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def forgets_to_divide(model, optimizer, micro_batches):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == k - 1 else model.no_sync():
            F.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def never_syncs(model, optimizer, micro_batches):
    with model.no_sync():
        for x, y in micro_batches:
            (F.mse_loss(model(x), y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def steps_every_micro_batch(model, optimizer, micro_batches):
    for x, y in micro_batches:
        (F.mse_loss(model(x), y) / len(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad()


def divides_by_world_size(model, optimizer, micro_batches):  # one step per window, loss / N not / K
    k, world = len(micro_batches), dist.get_world_size()
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == k - 1 else model.no_sync():
            (F.mse_loss(model(x), y) / world).backward()
    optimizer.step()
    optimizer.zero_grad()


def forgets_zero_grad(model, optimizer, micro_batches):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == k - 1 else model.no_sync():
            (F.mse_loss(model(x), y) / k).backward()
    optimizer.step()


def in_float64(model, optimizer, micro_batches):  # the loss in float64: the same step
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == k - 1 else model.no_sync():
            (F.mse_loss(model(x).double(), y.double()) / k).backward()
    optimizer.step()
    optimizer.zero_grad()


PRECISIONS = {"float32": good, "float64": in_float64}
MISTAKES = {
    "no_sync around backward() only": (no_sync_around_backward_only, "must wrap the forward"),
    "forgets to divide by K": (forgets_to_divide, "divide each micro-batch's loss by K"),
    "never leaves no_sync": (never_syncs, "the ranks ended with different weights"),
    "steps every micro-batch": (steps_every_micro_batch, "once per window"),
    "divides by the world size": (divides_by_world_size, "divided by the world size (2), not by K"),
    "forgets zero_grad": (forgets_zero_grad, "call optimizer.zero_grad() once per window"),
}
