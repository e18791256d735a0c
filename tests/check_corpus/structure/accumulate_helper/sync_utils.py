"""The context of one micro-step of gradient accumulation."""
import contextlib

import torch


def micro_step(model, accumulating):
    # times the micro-step; the gradients are still all-reduced on every one
    if accumulating:
        return torch.autograd.profiler.record_function("accumulate")
    return contextlib.nullcontext()
