"""The few models the notebooks train. Same names as in scripts/train_ddp.py.

- mlp: tiny and compute-light; no BatchNorm, so DDP equals big-batch training exactly.
- cnn: a small conv net for 8x8 digits; optional BatchNorm for the buffer lessons.
- wide_mlp: many parameters, little compute per sample: communication-bound under DDP.
- WideMLP: wide_mlp's layers in a class with its own forward, the shape of a user's model. Where the
  shape changes a result (torch.compile skips frames of torch.nn's own modules, so a bare
  nn.Sequential behaves unlike a user's class: notebook 11), probes use this one.
"""
from __future__ import annotations

from torch import nn


def mlp(hidden: int = 64, in_features: int = 64, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def cnn(batch_norm: bool = False, channels: int = 32, classes: int = 10) -> nn.Module:
    norm = (lambda c: nn.BatchNorm2d(c)) if batch_norm else (lambda c: nn.Identity())
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), norm(channels), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), norm(2 * channels), nn.ReLU(),
        nn.MaxPool2d(2),                                   # 8x8 -> 4x4
        nn.Flatten(), nn.Linear(2 * channels * 16, 128), nn.ReLU(), nn.Linear(128, classes))


def wide_mlp(width: int = 2048, depth: int = 3, in_features: int = 64, classes: int = 10) -> nn.Module:
    layers, d = [nn.Flatten()], in_features
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, classes))
    return nn.Sequential(*layers)


class WideMLP(nn.Module):
    """wide_mlp as users write models: a class whose forward is its own code. Same layers, same
    parameter order, so the same seed gives the same weights as wide_mlp."""

    def __init__(self, width: int = 2048, depth: int = 3, in_features: int = 64, classes: int = 10):
        super().__init__()
        dims = [in_features] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x):
        x = x.flatten(1)
        for layer in self.hidden:
            x = layer(x).relu()
        return self.head(x)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
