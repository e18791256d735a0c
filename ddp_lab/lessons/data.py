"""Small, offline data for the notebooks.

digits(): scikit-learn's bundled handwritten digits (1,797 real 8x8 images,
10 classes), shipped with the package, so nothing is downloaded.
"""
from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

VAL_SIZE = 297  # 1797 - 297 = 1500 training images; 297 is odd on purpose (uneven shards)


def digits_tensors(split: str = "train"):
    """(X, y): X float32 [N, 1, 8, 8] scaled to [0, 1], y int64; a fixed, seeded split."""
    from sklearn.datasets import load_digits  # lazy: sklearn import costs ~1 s

    d = load_digits()
    X = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    X, y = X[order], y[order]
    if split == "train":
        return X[VAL_SIZE:], y[VAL_SIZE:]
    if split == "val":
        return X[:VAL_SIZE], y[:VAL_SIZE]
    if split == "all":
        return X, y
    raise ValueError(f"split must be 'train', 'val' or 'all', not {split!r}")


def digits(split: str = "train") -> TensorDataset:
    return TensorDataset(*digits_tensors(split))
