"""09.6: right bytes per device and the wrong ones, each with the hint it must get."""
import numpy as np


def good(params, world, w, g, o, stage):
    split_w, split_g, split_o = stage >= 3, stage >= 2, stage >= 1
    return params * (w / (world if split_w else 1) + g / (world if split_g else 1)
                     + o / (world if split_o else 1))


def all_split(params, world, w, g, o, stage):
    return params * (w + g + o) / (world if stage else 1)


def one_stage_ahead(params, world, w, g, o, stage):
    return good(params, world, w, g, o, min(stage + 1, 3))


def ddp_split(params, world, w, g, o, stage):
    return params * (w + g + o) / world if stage == 0 else good(params, world, w, g, o, stage)


def no_gradients(params, world, w, g, o, stage):
    return good(params, world, w, 0, o, stage)


def in_float32(params, world, w, g, o, stage):
    f = np.float32
    return good(f(params), world, f(w), f(g), f(o), stage)


PRECISIONS = {"float32": in_float32, "float64": good}


MISTAKES = {
    "every stage splits everything": (all_split, "only ZeRO-3 splits everything"),
    "one stage ahead": (one_stage_ahead, "ZeRO-1 only the optimizer state"),
    "DDP split": (ddp_split, "DDP splits nothing"),
    "no gradients": (no_gradients, "the gradients take g bytes per parameter too"),
}
