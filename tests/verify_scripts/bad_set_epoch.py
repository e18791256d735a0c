"""Broken (a Trainer class): a DistributedSampler whose set_epoch is never called, so every epoch
repeats the first epoch's order."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Trainer:
    def __init__(self, model, loader, optimizer):
        self.model, self.loader, self.optimizer = DDP(model), loader, optimizer

    def run_epoch(self):
        for x, y in self.loader:
            self.optimizer.zero_grad()
            nn.functional.mse_loss(self.model(x), y).backward()
            self.optimizer.step()

    def train(self, epochs):
        for _ in range(epochs):
            self.run_epoch()  # missing: self.loader.sampler.set_epoch(epoch)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    model = nn.Linear(8, 1)
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, shuffle=True))
    Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=0.1)).train(epochs=3)
    dist.destroy_process_group()
