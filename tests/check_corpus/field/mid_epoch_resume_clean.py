"""Checkpoints every 50 steps, inside the batch loop, hold the batches of the epoch already done
with the step, and the resumed run skips that many batches of the same shuffled order."""
import datetime
import itertools
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank = int(os.environ["RANK"])
    data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    net = torch.nn.Linear(16, 1)
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epoch, step, done = 0, 0, 0
    if os.path.exists("last.pt"):
        ckpt = torch.load("last.pt", map_location="cpu", weights_only=True)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        epoch, step, done = ckpt["epoch"], ckpt["step"], ckpt["batches_done"]
    while epoch < 5:
        sampler.set_epoch(epoch)   # the same order as before the crash: skip the batches already trained
        for i, (x, y) in enumerate(itertools.islice(loader, done, None), start=done):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            step += 1
            if step % 50 == 0 and rank == 0:
                torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch, "step": step, "batches_done": i + 1}, "last.pt")
        epoch, done = epoch + 1, 0
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
