"""Correct, nanoGPT style: gradient accumulation that turns the all-reduce off with
`model.require_backward_grad_sync = (micro_step == K - 1)` instead of no_sync(), an
infinite-sampler-free loop over a DistributedSampler, a checkpoint every step on rank 0, dropout
with a seed per rank (1337 + rank, as nanoGPT's seed_offset), set after the data is made."""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

GRAD_ACCUM = 2


def get_batches(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main():
    dist.init_process_group("gloo")
    master = dist.get_rank() == 0
    torch.manual_seed(1337)
    data = TensorDataset(torch.randn(128, 8), torch.randn(128, 1))
    sampler = DistributedSampler(data)
    batches = get_batches(DataLoader(data, batch_size=16, sampler=sampler), sampler)
    torch.manual_seed(1337 + dist.get_rank())  # each rank its own dropout masks
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for it in range(6):
        for micro_step in range(GRAD_ACCUM):
            model.require_backward_grad_sync = (micro_step == GRAD_ACCUM - 1)
            x, y = next(batches)
            loss = nn.functional.mse_loss(model(x), y) / GRAD_ACCUM
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if master:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "iter": it},
                       os.path.join(os.getcwd(), "ckpt.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
