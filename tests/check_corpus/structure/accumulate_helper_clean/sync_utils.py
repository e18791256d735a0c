"""The context of one micro-step of gradient accumulation."""
import contextlib


def micro_step(model, accumulating):
    # DDP skips the all-reduce inside no_sync; the last micro-step of a window syncs
    return model.no_sync() if accumulating else contextlib.nullcontext()
