"""torch.compile over the DDP wrapper, then a memory-format change on the compiled name."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(net, local_rank):
    model = DDP(net.cuda(local_rank), device_ids=[local_rank])
    model = torch.compile(model)
    model = model.to(memory_format=torch.channels_last)
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
