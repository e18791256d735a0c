"""Broken resume (functions): the checkpoint holds the model and the step but not the optimizer,
so the momentum restarts from zero after a resume (the loss curve hides it; the weights do not)."""
import itertools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CKPT, STEPS, PER_EPOCH = "ckpt.pt", 6, 4  # 64 samples / 2 ranks / batch 8 = 4 steps per epoch


def save(model, optimizer, step):
    if dist.get_rank() == 0:
        torch.save(state(model, optimizer, step), CKPT + ".tmp")
        os.replace(CKPT + ".tmp", CKPT)


def state(model, optimizer, step):
    return {"model": model.module.state_dict(), "step": step}  # bug: no optimizer.state_dict()


def load(model, optimizer):
    if not os.path.exists(CKPT):
        return 0
    ckpt = torch.load(CKPT)
    model.module.load_state_dict(ckpt["model"])
    return ckpt["step"]


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(nn.Linear(8, 1))
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
