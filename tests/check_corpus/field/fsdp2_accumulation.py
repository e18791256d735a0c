"""A model sharded with FSDP2's fully_shard, trained with 4 micro-steps per optimizer step (and a
step helper over a list of micro-batches): every backward reduce-scatters the gradients, 3 of
every 4 for nothing."""
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ff = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.ff(x)


def train_step(model, optimizer, micro_batches):
    for x, y in micro_batches:
        loss = torch.nn.functional.mse_loss(model(x), y) / len(micro_batches)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def main(loader, accum_steps=4, dim=64):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    torch.manual_seed(int(os.environ.get("SEED", "0")))
    model = torch.nn.Sequential(*[Block(dim) for _ in range(4)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x), y) / accum_steps
        loss.backward()
        if (step + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
    dist.destroy_process_group()
