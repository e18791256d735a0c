"""Notebook 12, build it yourself: the model the graders train and DDP's bucket rule.

The learner writes DDP, a sharded Adam and SyncBatchNorm in the notebook; `ddp_lab.grade` runs
them on real gloo ranks against torch's own (exercises 12.1-12.4). What they share is here.
"""
from __future__ import annotations

import torch
from torch import nn

BUCKET_CAP_BYTES = 4096  # small on purpose: Net's 8 gradients fill 3 buckets of different sizes


class Net(nn.Module):
    """A model class as users write them: four Linear layers of four sizes, 8 parameter tensors."""

    def __init__(self, d_in: int = 32, hidden: int = 64, mid: int = 16, classes: int = 4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden)
        self.fc3, self.head = nn.Linear(hidden, mid), nn.Linear(mid, classes)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.head(torch.relu(self.fc3(x)))


def plan_buckets(params, cap_bytes: int = BUCKET_CAP_BYTES) -> list[list]:
    """DDP's rule: walk the parameters in reverse, the order backward makes their gradients, add each
    to the open bucket, and close the bucket once it holds cap_bytes or more."""
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def bucket_sizes(params, cap_bytes: int = BUCKET_CAP_BYTES) -> list[int]:
    """Elements in each bucket, in the order DDP fills them."""
    return [sum(p.numel() for p in bucket) for bucket in plan_buckets(params, cap_bytes)]


def ready_order(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The parameters' names in the order backward finishes their gradients, seen by a
    post-accumulate-grad hook on each: the order DDP's buckets fill."""
    seen, handles = [], []
    for name, p in model.named_parameters():
        handles.append(p.register_post_accumulate_grad_hook(lambda p, name=name: seen.append(name)))
    model(x).sum().backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return seen
