"""Broken (a Trainer class with accumulation and checkpoints): 4 micro-batches per step, each
backward all-reduces because no_sync() is never used. Correct results, 4x the traffic."""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ACCUM = 4


class Trainer:
    def __init__(self, model, data):
        self.model = DDP(model)
        self.sampler = DistributedSampler(data)
        self.loader = DataLoader(data, batch_size=4, sampler=self.sampler)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def save(self, epoch):
        if dist.get_rank() == 0:
            state = {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "epoch": epoch}
            torch.save(state, os.path.join("checkpoints", "last.pt"))

    def train(self, epochs):
        os.makedirs("checkpoints", exist_ok=True)
        for epoch in range(epochs):
            self.sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(self.loader):
                loss = nn.functional.mse_loss(self.model(x), y) / ACCUM
                loss.backward()  # bug: all-reduces on every micro-batch (no no_sync)
                if (i + 1) % ACCUM == 0:
                    self.optimizer.step()
                    self.optimizer.zero_grad()
            self.save(epoch)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    trainer = Trainer(nn.Linear(8, 1), TensorDataset(torch.randn(64, 8), torch.randn(64, 1)))
    trainer.train(epochs=2)
    del trainer
    dist.destroy_process_group()
