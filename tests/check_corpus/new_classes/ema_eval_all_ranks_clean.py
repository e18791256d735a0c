"""A timm-shaped EMA, updated on every rank (their DDP parameters are equal, so every copy is the
same), then evaluated on every rank's shard with the metric all-reduced."""
import copy
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class ModelEma:
    def __init__(self, model, decay=0.999):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for e, p in zip(self.module.state_dict().values(), model.state_dict().values()):
            e.mul_(self.decay).add_(p, alpha=1 - self.decay)


def evaluate(model, loader):
    correct = torch.zeros(2)
    with torch.no_grad():
        for x, y in loader:
            correct += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
    dist.all_reduce(correct)
    return (correct[0] / correct[1]).item()


def train(net, loader, val_loader, epochs):
    rank = int(os.environ["RANK"])
    model = DDP(net)
    model_ema = ModelEma(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            model_ema.update(model.module)
        acc = evaluate(model_ema.module, val_loader)
        if rank == 0:
            print(f"epoch {epoch}: EMA accuracy {acc:.3f}")
