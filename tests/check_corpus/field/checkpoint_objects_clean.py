"""The checkpoint holds plain data (a dict of the arguments, the config as a dict, state dicts),
so torch.load reads it back with weights_only=True; the final export is the state dict."""
import argparse
import dataclasses
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class TrainConfig:
    width: int = 64
    lr: float = 0.01


class Net(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.body = torch.nn.Linear(cfg.width, 1)

    def forward(self, x):
        return self.body(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    cfg = TrainConfig()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank = int(os.environ["RANK"])
    net = Net(cfg)
    model = DDP(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    start = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        start = ckpt["epoch"] + 1
    for epoch in range(start, 5):
        optimizer.zero_grad()
        model(torch.randn(8, cfg.width)).sum().backward()
        optimizer.step()
        if rank == 0:
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                        "args": vars(args),
                        "config": dataclasses.asdict(cfg)}, "last.pt")
    if rank == 0:
        torch.save(net.state_dict(), "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
