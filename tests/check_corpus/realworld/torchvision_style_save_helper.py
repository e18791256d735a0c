"""torchvision references-style classification: a save_checkpoint() helper, called at the end of
every epoch on every rank.

    torchrun --nproc_per_node=8 torchvision_style_save_helper.py --output-dir out
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def save_checkpoint(state, path):
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def train_one_epoch(model, criterion, optimizer, loader):
    model.train()
    for image, target in loader:
        loss = criterion(model(image), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    dataset = TensorDataset(torch.randn(512, 32), torch.randint(0, 10, (512,)))
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    model = torch.nn.Linear(32, 10)
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train_one_epoch(model, torch.nn.CrossEntropyLoss(), optimizer, loader)
        lr_scheduler.step()
        checkpoint = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                      "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args}
        save_checkpoint(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", default=".")
    parser.add_argument("--epochs", type=int, default=3)
    main(parser.parse_args())
