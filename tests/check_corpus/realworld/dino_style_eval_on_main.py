"""DINO/MAE-style: small helpers (is_main_process, init_distributed_mode), an evaluate() that
averages its accuracy over ranks, and a rank-0-only evaluation in the epoch loop.

    torchrun --nproc_per_node=8 dino_style_eval_on_main.py --data_path /path/to/imagenet
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    if not is_dist_avail_and_initialized():
        return 0
    return dist.get_rank()


def is_main_process():
    return get_rank() == 0


def init_distributed_mode(args):
    args.rank = int(os.environ["RANK"])
    args.world_size = int(os.environ["WORLD_SIZE"])
    args.gpu = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo",
                            timeout=datetime.timedelta(minutes=10))
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for images, target in loader:
        output = model(images.to(device))
        stats[0] += (output.argmax(1) == target.to(device)).sum()
        stats[1] += target.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def train_one_epoch(model, loader, optimizer, device):
    model.train()
    for images, target in loader:
        loss = torch.nn.functional.cross_entropy(model(images.to(device)), target.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main(args):
    init_distributed_mode(args)
    device = torch.device("cuda", args.gpu)
    model = torch.nn.Linear(32, 10).to(device)
    model = DDP(model, device_ids=[args.gpu])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randint(0, 10, (512,)))
    train_sampler = DistributedSampler(data)
    train_loader = DataLoader(data, batch_size=64, sampler=train_sampler)
    val_loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data, shuffle=False))
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, train_loader, optimizer, device)
        if is_main_process():
            acc = evaluate(model, val_loader, device)
            print(f"epoch {epoch} top-1 {acc:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    main(parser.parse_args())
