"""A Trainer whose micro-steps choose their context (no_sync on all but the last of a window) and
which clips only when the optimizer steps, on the all-reduced gradients."""
import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel


class Trainer:
    def __init__(self, model, device, accumulate=4, clip=0.5):
        self.model = DistributedDataParallel(model.to(device), device_ids=[device.index])
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.accumulate, self.clip = accumulate, clip

    def run_epoch(self, loader):
        for i, (x, y) in enumerate(loader):
            sync = (i + 1) % self.accumulate == 0
            context = contextlib.nullcontext() if sync else self.model.no_sync()
            with context:
                loss = torch.nn.functional.cross_entropy(self.model(x), y) / self.accumulate
                loss.backward()
            if sync:
                torch.nn.utils.clip_grad_value_(self.model.parameters(), self.clip)
                self.optimizer.step()
                self.optimizer.zero_grad()
