"""The per-rank batch is fixed (32), so the global batch grows with the world size, and the
learning rate grows with it (the linear scaling rule)."""
import argparse
import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-per-rank", type=int, default=32)
    parser.add_argument("--base-lr", type=float, default=0.1)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    world_size = dist.get_world_size()
    data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=args.batch_per_rank, sampler=sampler)
    model = DDP(torch.nn.Linear(32, 1))
    lr = args.base_lr * world_size
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch in range(10):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
