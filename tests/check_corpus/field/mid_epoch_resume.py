"""Checkpoints every 50 steps, inside the batch loop, hold the epoch and the step but not where in
the epoch the run was: the resumed run starts the epoch's loader from its first batch again."""
import datetime
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
    epoch, step = 0, 0
    if os.path.exists("last.pt"):
        ckpt = torch.load("last.pt", map_location="cpu", weights_only=True)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        epoch, step = ckpt["epoch"], ckpt["step"]
    while epoch < 5:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            step += 1
            if step % 50 == 0 and rank == 0:
                torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch, "step": step}, "last.pt")
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
