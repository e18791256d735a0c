"""The memory format set on the plain model, then DDP, then torch.compile over the wrapper."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(net, local_rank):
    net = net.cuda(local_rank).to(memory_format=torch.channels_last)
    model = DDP(net, device_ids=[local_rank])
    model = torch.compile(model)
    return model


def train(loader, net):
    local_rank = int(os.environ["LOCAL_RANK"])
    model = setup(net, local_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()
