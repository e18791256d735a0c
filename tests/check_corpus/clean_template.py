"""A correct DDP training script that uses every pattern the checker knows, the right way.
The checker must report nothing here.

    torchrun --standalone --nproc_per_node=4 clean_template.py --epochs 3 --accum 4
"""
import argparse
import contextlib
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


@contextlib.contextmanager
def local_zero_first(local_rank: int):
    """Local rank 0 prepares the data on each node while the others wait (node-local disk)."""
    if local_rank != 0:
        dist.barrier()
    yield
    if local_rank == 0:
        dist.barrier()


def setup():
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return rank, world_size, local_rank, device


def build_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Flatten(), nn.Dropout(0.1), nn.Linear(16 * 8 * 8, 10))


def load_state(path, rank):
    """Rank 0 reads the file; every rank gets it by broadcast (no shared filesystem needed)."""
    box = [None]
    if rank == 0 and os.path.exists(path):
        box[0] = torch.load(path, map_location="cpu", weights_only=True)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default="last.pt")
    args = p.parse_args()
    rank, world_size, local_rank, device = setup()

    with local_zero_first(local_rank):
        data = TensorDataset(torch.randn(4096, 1, 8, 8), torch.randint(0, 10, (4096,)))

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = build_model()
    if device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    state = load_state(args.ckpt, rank)
    if state is not None:
        model.load_state_dict(state["model"])
    torch.manual_seed(args.seed + rank)  # from here on: each rank its own dropout masks
    ddp_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    amp_dtype = torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # bf16 needs no loss scaling

    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss_sum = torch.zeros(2, device=device)  # [sum of losses, batches] on this rank
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            last_micro_step = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if last_micro_step else ddp_model.no_sync():
                with torch.autocast(device.type, dtype=amp_dtype):
                    loss = F.cross_entropy(ddp_model(x), y) / args.accum
                scaler.scale(loss).backward()
            loss_sum += torch.stack([loss.detach() * args.accum, torch.ones((), device=device)])
            if last_micro_step:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        epoch_loss = (loss_sum[0] / loss_sum[1]).item()
        my_loss = loss.item()
        print(f"rank {rank}: last micro-batch loss {my_loss:.4f}", flush=True)  # says whose number it is
        if rank == 0:
            print(f"epoch {epoch} mean loss over all ranks {epoch_loss:.4f}", flush=True)
            torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, args.ckpt)
        torch.save({"rng": torch.get_rng_state()}, f"rng_rank{rank}.pt")  # one file per rank
        dist.barrier()  # nobody reads or exits before the checkpoint is complete

    if rank == 0:  # the whole validation set on one rank: every weight is the same everywhere
        ddp_model.module.eval()
        with torch.no_grad():
            val_x, val_y = data.tensors
            val_acc = (ddp_model.module(val_x.to(device)).argmax(1) == val_y.to(device)).float().mean().item()
        print(f"validation accuracy {val_acc:.4f}")
    del ddp_model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
