"""A resumable sampler derived from DistributedSampler, and a subclass of that; the epoch loop
never calls set_epoch, so every epoch repeats epoch 0's order."""
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class SkippingSampler(DistributedSampler):
    start = 0

    def __iter__(self):
        order = list(super().__iter__())
        return iter(order[self.start:])


class WeightedSkippingSampler(SkippingSampler):
    weight = 1.0


def main():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    rank = int(os.environ["RANK"])
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    sampler = WeightedSkippingSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
