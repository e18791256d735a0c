"""torchvision's references/classification/train.py shape: the checkpoint holds `args` (an
argparse Namespace) and the resume reads it with weights_only=False, knowingly: it is the
program's own file.

    torchrun --nproc_per_node=8 torchvision_style_args_in_checkpoint.py --resume checkpoint.pth
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def save_on_master(*args, **kwargs):
    if dist.get_rank() == 0:
        torch.save(*args, **kwargs)


def main(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    model = torch.nn.Linear(8, 2)
    model_without_ddp = model
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=False)
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"] + 1
    for epoch in range(start_epoch, args.epochs):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        checkpoint = {
            "model": model_without_ddp.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch,
            "args": args,
        }
        save_on_master(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
    dist.destroy_process_group()


def get_args_parser():
    parser = argparse.ArgumentParser(description="PyTorch Classification Training")
    parser.add_argument("--lr", default=0.1, type=float)
    parser.add_argument("--epochs", default=2, type=int)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--output-dir", default=".", type=str)
    return parser


if __name__ == "__main__":
    main(get_args_parser().parse_args())
