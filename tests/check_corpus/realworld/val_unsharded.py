"""Validation on the whole set on every rank (no DistributedSampler): each rank's accuracy is the
job's, so rank 0 prints its own without a reduction. The training loader is sharded.

    torchrun --nproc_per_node=2 val_unsharded.py
"""
import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank()
    train_set = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    val_set = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=64, shuffle=False)
    model = DDP(torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in val_loader:
                correct += (model(x).argmax(1) == y).sum().item()
        if rank == 0:
            print(f"epoch {epoch} val accuracy {correct / len(val_set):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
