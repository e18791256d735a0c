"""Correct resume of per-rank random state: each rank draws its own dropout masks (seeded with
1 + rank); rank 0's checkpoint holds every rank's random state, and each rank loads its own."""
import itertools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CKPT, STEPS, PER_EPOCH = "ckpt.pt", 6, 4  # 64 samples / 2 ranks / batch 8 = 4 steps per epoch


def save(model, optimizer, step):
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, torch.get_rng_state())  # every rank's random state, in rank order
    if dist.get_rank() == 0:
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                 "rng": rng}
        torch.save(state, CKPT + ".tmp")
        os.replace(CKPT + ".tmp", CKPT)


def load(model, optimizer):
    if not os.path.exists(CKPT):
        return 0
    ckpt = torch.load(CKPT)
    model.module.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"][dist.get_rank()])  # each rank its own stream
    return ckpt["step"]


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    sampler = DistributedSampler(data)
    # the loader's own generator: its seed draw stays off the global stream the checkpoint restores
    loader = DataLoader(data, batch_size=8, sampler=sampler, generator=torch.Generator().manual_seed(0))
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1)))
    torch.manual_seed(1 + rank)  # each rank its own dropout masks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = load(model, optimizer)
    dist.barrier()  # nobody saves over the checkpoint before every rank has read it
    while step < STEPS:
        epoch, done = divmod(step, PER_EPOCH)
        sampler.set_epoch(epoch)
        for x, y in itertools.islice(loader, done, None):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            step += 1
            save(model, optimizer, step)
            if step == STEPS:
                break
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
