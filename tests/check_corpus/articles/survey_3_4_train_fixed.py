# The survey article, section 3.4, fixed: the backend from the device and a timeout; the same seed
# on every rank while the model is built, then a seed per rank; DDP's default broadcast_buffers=True;
# a checkpoint that holds the scheduler, written atomically by rank 0 and followed by a barrier; the DDP
# model released before the process group is destroyed.
import datetime
import gc
import os
import random
import numpy as np

import torch
import torch.nn as nn
import torch.distributed as dist

from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import datasets, transforms, models


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])

    torch.cuda.set_device(local_rank)

    dist.init_process_group(
        backend="nccl" if torch.cuda.is_available() else "gloo",
        init_method="env://",
        timeout=datetime.timedelta(minutes=10)
    )

    return local_rank


def cleanup():
    # a DDP model still alive here can abort the process at exit: train() releases it first
    gc.collect()
    dist.destroy_process_group()


def atomic_save(state, path):
    # a crash mid-write leaves the previous checkpoint intact: write a temp file, then rename it
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def build_model(num_classes):
    model = models.resnet18(weights=None)
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    return model


def train():
    local_rank = setup()
    rank = dist.get_rank()

    seed_everything(42)

    transform = transforms.Compose([
        transforms.Resize((224, 224)),
        transforms.ToTensor(),
        transforms.Normalize(
            mean=[0.485, 0.456, 0.406],
            std=[0.229, 0.224, 0.225]
        )
    ])

    dataset = datasets.ImageFolder(
        root="./data/train",
        transform=transform
    )

    sampler = DistributedSampler(
        dataset=dataset,
        num_replicas=dist.get_world_size(),
        rank=rank,
        shuffle=True
    )

    dataloader = DataLoader(
        dataset,
        batch_size=64,
        sampler=sampler,
        num_workers=4,
        pin_memory=True,
        persistent_workers=True
    )

    model = build_model(num_classes=len(dataset.classes))
    model = model.cuda(local_rank)
    seed_everything(42 + rank)  # from here on each rank its own dropout and augmentation

    model = DDP(
        model,
        device_ids=[local_rank],
        output_device=local_rank
    )

    criterion = nn.CrossEntropyLoss().cuda(local_rank)

    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=1e-3,
        weight_decay=1e-4
    )

    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer,
        T_max=50
    )

    num_epochs = 50

    for epoch in range(num_epochs):
        model.train()
        sampler.set_epoch(epoch)

        total_loss = 0.0
        total_samples = 0

        for images, labels in dataloader:
            images = images.cuda(local_rank, non_blocking=True)
            labels = labels.cuda(local_rank, non_blocking=True)

            optimizer.zero_grad(set_to_none=True)

            outputs = model(images)
            loss = criterion(outputs, labels)

            loss.backward()
            optimizer.step()

            total_loss += loss.item() * images.size(0)
            total_samples += images.size(0)

        scheduler.step()

        loss_tensor = torch.tensor(
            [total_loss, total_samples],
            dtype=torch.float64,
            device=local_rank
        )

        dist.all_reduce(
            loss_tensor,
            op=dist.ReduceOp.SUM
        )

        global_loss = loss_tensor[0] / loss_tensor[1]

        if rank == 0:
            print(
                f"Epoch [{epoch + 1}/{num_epochs}], "
                f"loss={global_loss.item():.6f}, "
                f"lr={scheduler.get_last_lr()[0]:.8f}"
            )

            atomic_save(
                {
                    "epoch": epoch,
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()
                },
                "./checkpoint.pt"
            )
        dist.barrier()  # no rank reads or exits before rank 0's save is complete

    del model, optimizer, scheduler
    cleanup()


if __name__ == "__main__":
    train()
