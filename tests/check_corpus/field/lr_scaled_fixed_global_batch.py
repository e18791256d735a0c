"""The global batch is fixed (256, split among the ranks) and the learning rate is still scaled by
the world size: on 8 ranks the same 256-sample step takes an 8x larger lr."""
import argparse
import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--base-lr", type=float, default=0.1)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    world_size = dist.get_world_size()
    per_rank_batch = args.global_batch // world_size
    data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=per_rank_batch, sampler=sampler)
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
