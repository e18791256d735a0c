"""timm train.py's train_one_epoch shape: the loss is all-reduced (reduce_tensor) and then averaged
in an AverageMeter, which rank 0 logs.

    torchrun --nproc_per_node=8 timm_style_meter.py
"""
import datetime
import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

_logger = logging.getLogger("train")


class AverageMeter:
    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def reduce_tensor(tensor, n):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= n
    return rt


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args):
    losses_m = AverageMeter()
    model.train()
    for batch_idx, (input, target) in enumerate(loader):
        loss = loss_fn(model(input), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            reduced_loss = reduce_tensor(loss.data, args.world_size)
            losses_m.update(reduced_loss.item(), input.size(0))
            if args.rank == 0:
                _logger.info("Train: {} [{}/{}] Loss: {loss.val:#.4g} ({loss.avg:#.3g})".format(
                    epoch, batch_idx, len(loader), loss=losses_m))


class Args:
    log_interval = 10
    epochs = 2


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    args = Args()
    args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = DDP(torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train_one_epoch(epoch, model, loader, optimizer, torch.nn.CrossEntropyLoss(), args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
