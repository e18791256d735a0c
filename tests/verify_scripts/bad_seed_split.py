"""Broken (functions): a hand-made split whose permutation is seeded with the rank, so the ranks'
shards overlap (and some samples are never seen)."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset


def shard(data, rank, world):
    g = torch.Generator().manual_seed(rank)  # bug: each rank permutes differently
    perm = torch.randperm(len(data), generator=g).tolist()
    return Subset(data, perm[rank::world])


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = DataLoader(shard(data, rank, world), batch_size=16, shuffle=True)
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
