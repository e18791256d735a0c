"""The survey's section 3.4 program (tests/check_corpus/articles/survey_3_4_train.py), on CPU.

Kept line for line where it matters here: setup() / cleanup() helpers, the DDP model a local of
train(), AdamW and CosineAnnealingLR, the epoch loop with its loss all-reduce and rank-0 save, and
cleanup() -> dist.destroy_process_group() as train()'s last line, with `model` still referenced.
What changes is marked # CPU: gloo instead of NCCL, a small conv net and synthetic images instead
of torchvision's resnet18 and ImageFolder (importing torchvision costs seconds), no worker
processes, 2 epochs. --fixed ends train() as survey_3_4_train_fixed.py does: release, then destroy.
"""
import gc
import os
import random
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist

from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group(backend="gloo", init_method="env://")  # CPU: gloo
    return local_rank


def cleanup():
    dist.destroy_process_group()


def build_model(num_classes):  # CPU: a small conv net with BatchNorm stands in for resnet18
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))


def train(fixed=False):
    local_rank = setup()
    rank = dist.get_rank()

    seed_everything(42 + rank)

    g = torch.Generator().manual_seed(0)  # CPU: synthetic images, 4 classes
    dataset = TensorDataset(torch.randn(64, 3, 16, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    dataset.classes = ["a", "b", "c", "d"]

    sampler = DistributedSampler(dataset=dataset, num_replicas=dist.get_world_size(), rank=rank, shuffle=True)
    dataloader = DataLoader(dataset, batch_size=16, sampler=sampler)  # CPU: no worker processes

    model = build_model(num_classes=len(dataset.classes))
    model = DDP(model, broadcast_buffers=False)  # CPU: no device_ids

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=50)

    num_epochs = 2  # CPU: 2 of the survey's 50

    for epoch in range(num_epochs):
        model.train()
        sampler.set_epoch(epoch)
        total_loss = 0.0
        total_samples = 0
        for images, labels in dataloader:
            optimizer.zero_grad(set_to_none=True)
            outputs = model(images)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * images.size(0)
            total_samples += images.size(0)
        scheduler.step()

        loss_tensor = torch.tensor([total_loss, total_samples], dtype=torch.float64)
        dist.all_reduce(loss_tensor, op=dist.ReduceOp.SUM)
        global_loss = loss_tensor[0] / loss_tensor[1]

        if rank == 0:
            print(f"Epoch [{epoch + 1}/{num_epochs}], loss={global_loss.item():.6f}, "
                  f"lr={scheduler.get_last_lr()[0]:.8f}")
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, "./checkpoint.pt")

    if fixed:  # survey_3_4_train_fixed.py: release DDP, collect, then destroy
        del model, optimizer, scheduler
        gc.collect()
    cleanup()


def main(argv=()):
    train(fixed="--fixed" in argv)


if __name__ == "__main__":
    main(sys.argv[1:])
