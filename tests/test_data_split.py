"""ddp_lab.lessons.data: the train/validation split every notebook trains and validates on.

Checked against scikit-learn's digits themselves, not against the module's own indices: each
image with its label counts as one sample, so a sample in both splits, or one in neither, shows
up as a difference in counts."""
from collections import Counter

import torch

from ddp_lab.lessons import data


def _samples(X, y) -> Counter:
    """Each sample as (its 64 pixel values on the 0-16 scale, its label), counted."""
    pixels = (X.reshape(len(X), -1) * 16).round().to(torch.int64)
    return Counter((tuple(p.tolist()), int(t)) for p, t in zip(pixels, y))


def test_train_and_validation_are_disjoint_and_together_the_whole_set():
    from sklearn.datasets import load_digits

    d = load_digits()
    whole = Counter((tuple(int(v) for v in image.ravel()), int(t)) for image, t in zip(d.images, d.target))
    train, val = _samples(*data.digits_tensors("train")), _samples(*data.digits_tensors("val"))
    # equal counts: a sample in both splits would be counted once too often, one in neither once too few
    # (an image the set holds twice may sit once in each split, as it does in the set)
    assert train + val == whole
    assert 0 < sum(val.values()) < sum(train.values())
    assert {t for _, t in val} == set(range(10))  # every class is validated on


def test_every_rank_gets_the_same_split_whatever_its_seed():
    # Ranks seed themselves differently (notebook 01: 42 + rank); the split must not move with the seed,
    # or one rank would validate on samples another rank trained on
    splits = []
    for seed in (0, 43):
        torch.manual_seed(seed)
        splits.append([data.digits_tensors(s) for s in ("train", "val")])
    for (x0, y0), (x1, y1) in zip(*splits):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
