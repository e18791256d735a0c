"""A detectron2-shaped setup: a helper wraps the model, and the caller moves it afterwards."""
import torch
from torch.nn.parallel import DistributedDataParallel


def create_ddp_model(model, *, fp16_compression=False, **kwargs):
    ddp = DistributedDataParallel(model, **kwargs)
    return ddp


def build_model(cfg):
    return torch.nn.Sequential(torch.nn.Conv2d(3, cfg.width, 3), torch.nn.ReLU())


def do_train(cfg, loader):
    model = build_model(cfg)
    model = create_ddp_model(model, broadcast_buffers=False)
    model.to(torch.device(cfg.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for data in loader:
        losses = model(data).sum()
        optimizer.zero_grad()
        losses.backward()
        optimizer.step()
