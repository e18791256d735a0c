"""A Trainer in the shape of pytorch/examples' ddp-tutorial-series: the epoch loop in train(), the
batch loop in _run_epoch(), one batch in _run_batch().

    torchrun --standalone --nproc_per_node=2 trainer_epoch_method.py
"""
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, model, dataset, optimizer, batch_size):
        self.rank = dist.get_rank()
        self.model = DDP(model)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset))
        self.optimizer = optimizer

    def _run_batch(self, x, y):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        for x, y in self.loader:
            self._run_batch(x, y)

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    data = TensorDataset(torch.randn(256, 20), torch.randint(0, 10, (256,)))
    model = torch.nn.Linear(20, 10)
    trainer = Trainer(model, data, torch.optim.SGD(model.parameters(), lr=0.1), 32)
    trainer.train(int(os.environ.get("EPOCHS", "3")))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
