"""A fairseq-shaped trainer: every sample but the last runs under no_sync, so DDP all-reduces once."""
import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel


class Trainer:
    def __init__(self, task, model, device):
        self.task = task
        self.model = DistributedDataParallel(model.to(device), device_ids=[device.index])
        self.solver = torch.optim.Adam(self.model.parameters(), lr=5e-4)

    def train_step(self, samples):
        self.model.train()
        logging_outputs = []
        for i, sample in enumerate(samples):
            last = i == len(samples) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                loss, sample_size, log = self.task.train_step(sample, self.model)
                loss.backward()
            logging_outputs.append(log)
        self.solver.step()
        self.solver.zero_grad()
        return logging_outputs
