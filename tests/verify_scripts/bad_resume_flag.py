"""Resumes only when asked (argparse): `--resume` loads the checkpoint if there is one. Correct
when verify is given the flag (`ddp-lab verify --resume -- bad_resume_flag.py --resume`); without
it, the relaunch after a crash trains from step 1 again."""
import argparse
import itertools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CKPT, STEPS, PER_EPOCH = "ckpt.pt", 6, 4  # 64 samples / 2 ranks / batch 8 = 4 steps per epoch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", action="store_true", help="load ckpt.pt when it exists")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = 0
    if args.resume and os.path.exists(CKPT):
        ckpt = torch.load(CKPT)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
    dist.barrier()  # nobody saves over the checkpoint before every rank has read it
    while step < STEPS:
        epoch, done = divmod(step, PER_EPOCH)
        sampler.set_epoch(epoch)
        for x, y in itertools.islice(loader, done, None):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            step += 1
            if dist.get_rank() == 0:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                torch.save(state, CKPT + ".tmp")
                os.replace(CKPT + ".tmp", CKPT)
            if step == STEPS:
                break
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
