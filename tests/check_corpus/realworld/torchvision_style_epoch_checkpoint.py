"""torchvision's classification reference: train_one_epoch() walks the loader, and main() saves
the checkpoint (model, optimizer, epoch) after each epoch, outside the batch loop; a resume starts
at the next epoch's first batch, which is where the saved run stopped.

    torchrun --nproc_per_node=8 torchvision_style_epoch_checkpoint.py --resume output/checkpoint.pth
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def train_one_epoch(model, criterion, optimizer, data_loader, epoch):
    model.train()
    for image, target in data_loader:
        loss = criterion(model(image), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def save_on_master(state, path):
    if dist.get_rank() == 0:
        torch.save(state, path)


def main(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    dataset = TensorDataset(torch.randn(1024, 8), torch.randint(0, 10, (1024,)))
    train_sampler = DistributedSampler(dataset)
    data_loader = DataLoader(dataset, batch_size=32, sampler=train_sampler)
    model_without_ddp = torch.nn.Linear(8, 10)
    model = DDP(model_without_ddp)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=True)
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        args.start_epoch = checkpoint["epoch"] + 1
    for epoch in range(args.start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, optimizer, data_loader, epoch)
        checkpoint = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                      "epoch": epoch, "step": (epoch + 1) * len(data_loader)}
        save_on_master(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", default="")
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--epochs", default=90, type=int)
    parser.add_argument("--output-dir", default=".")
    main(parser.parse_args())
