"""Broken (a Trainer class): broadcast_buffers=False with BatchNorm, so each rank's running
statistics follow its own shard and the replicas' buffers drift apart."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Trainer:
    def __init__(self):
        torch.manual_seed(0)
        self.data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
        self.sampler = DistributedSampler(self.data)
        self.loader = DataLoader(self.data, batch_size=16, sampler=self.sampler)
        net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.model = DDP(net, broadcast_buffers=False)  # bug: each rank keeps its own BatchNorm statistics
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def fit(self, epochs):
        for epoch in range(epochs):
            self.sampler.set_epoch(epoch)
            for x, y in self.loader:
                self.optimizer.zero_grad()
                nn.functional.mse_loss(self.model(x), y).backward()
                self.optimizer.step()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    trainer = Trainer()
    trainer.fit(epochs=2)
    del trainer
    dist.destroy_process_group()
