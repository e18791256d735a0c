"""torch.optim.swa_utils with the average updated under a rank-0 check, and a hand-written EMA of
the same kind: both are used only on rank 0, which is harmless (the DDP parameters are the same
everywhere)."""
import datetime
import os

import torch
import torch.distributed as dist
from torch.optim.swa_utils import AveragedModel
from torch.nn.parallel import DistributedDataParallel as DDP


def main(net, loader, epochs, swa_start):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    is_main = dist.get_rank() == 0
    model = DDP(net)
    swa_model = AveragedModel(net)
    ema_net = AveragedModel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if is_main:
                with torch.no_grad():
                    for p_ema, p in zip(ema_net.parameters(), net.parameters()):
                        p_ema.mul_(0.99).add_(p, alpha=0.01)
        if epoch >= swa_start and is_main:
            swa_model.update_parameters(net)
    if is_main:
        torch.save(swa_model.state_dict(), os.path.join("out", "swa.pt"))
        torch.save({"ema": ema_net.state_dict()}, os.path.join("out", "ema.pt"))
    dist.destroy_process_group()
