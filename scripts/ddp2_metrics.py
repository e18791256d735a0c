"""Rung 2 of the ladder: metrics done right. Every number is global (reduced across ranks before
rank 0 prints it), the validation set is counted exactly once, and rank 0 writes JSON lines for
plots; on real data (scikit-learn's handwritten digits) and with a command line.

    python scripts/ddp2_metrics.py --epochs 3 --metrics-out runs/m.jsonl
    torchrun --standalone --nproc_per_node=2 scripts/ddp2_metrics.py --metrics-out runs/m.jsonl
"""
import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--epochs", type=int, default=3)
    a("--batch-size", type=int, default=32, help="per rank")
    a("--lr", type=float, default=0.05, help="for one process with --batch-size")
    a("--seed", type=int, default=0)
    a("--metrics-out", default=None, help="JSON lines file (appended, rank 0)")
    a("--log-every", type=int, default=50, help="steps between train records (each is a sync point)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- distributed setup
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup():
    """Join torchrun's group, or make a world of one so the same code runs unlaunched."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # picks the GPU; the global rank shards data
    # NCCL needs a GPU of its own for every process on this node; otherwise use the CPU and gloo.
    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        torch.cuda.set_device(local_rank)  # before init, so NCCL binds each process to its own GPU
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # NCCL binds this GPU at init (without device_id every barrier() warns it is guessing the GPU)
    device_id = device if device.type == "cuda" else None
    timeout = datetime.timedelta(seconds=300)  # a lost rank fails loudly, never hangs
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1, timeout=timeout, device_id=device_id)
    return rank, world_size, device, backend


# ---------------------------------------------------------------- data
def load_digits_split():
    """scikit-learn's bundled digits: the same seeded split as the workbook (297 val, 1500 train)."""
    from sklearn.datasets import load_digits  # lazy: the only non-torch import, digits only

    d = load_digits()
    X = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    X, y = X[order], y[order]
    return TensorDataset(X[297:], y[297:]), TensorDataset(X[:297], y[:297]), 10


def build_data(args, rank):
    """(train set, validation set, number of classes); each sample is (input tensor, class index)."""
    return load_digits_split()


# ---------------------------------------------------------------- model
def build_model(args, shape, classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), 64), nn.ReLU(), nn.Linear(64, classes))


# ---------------------------------------------------------------- checkpoints and metrics
class Metrics:
    """JSON lines on rank 0, appended so a torchrun restart adds to the same file."""

    def __init__(self, path, enabled, attempt):
        self.attempt, self.f = attempt, None
        if path and enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.f = open(path, "a", encoding="utf-8")

    def write(self, kind, **fields):
        if self.f:
            self.f.write(json.dumps({"kind": kind, "attempt": self.attempt, **fields}) + "\n")
            self.f.flush()  # a crash must not lose what was already reported


# ---------------------------------------------------------------- the training loop's pieces
def evaluation_loader(val_set, rank, world_size):
    """Every validation sample on exactly one rank (rank, rank + world_size, ...): no padding
    copies, which DistributedSampler adds to even out shards and which would count twice."""
    return DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=256)


def evaluate(model, loader, device):
    """(loss, accuracy, count) over the whole validation set. `model` is the unwrapped model:
    ranks may hold different numbers of batches here, and DDP's forward expects them equal."""
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64, device=device)  # [loss sum, correct, count]
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x).float()
            stats += torch.stack([F.cross_entropy(out, y, reduction="sum").double(),
                                  (out.argmax(1) == y).sum().double(), torch.tensor(float(len(y)), dtype=torch.float64, device=device)])
    dist.all_reduce(stats)  # global numbers, not rank 0's shard
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item(), int(stats[2].item())


class Window:
    """This rank's step losses and samples since the last train record (one all-reduce per record)."""

    def __init__(self, device):
        self.loss, self.device = torch.zeros((), device=device), device
        self.steps, self.samples, self.t0 = 0, 0, time.perf_counter()

    def add(self, loss, samples):
        self.loss += loss
        self.samples += samples

    @contextlib.contextmanager
    def paused(self):  # samples/s measures training, not evaluation
        t = time.perf_counter()
        yield
        self.t0 += time.perf_counter() - t

    def record(self, **fields):
        """Global mean loss per step and global samples/s over the window; every rank must call it."""
        w = torch.tensor([self.loss.item(), self.samples], dtype=torch.float64, device=self.device)
        dist.all_reduce(w)  # a sync point: --log-every keeps it off most steps
        rec = dict(fields, loss=w[0].item() / self.steps / dist.get_world_size(),
                   samples_per_s=w[1].item() / (time.perf_counter() - self.t0))
        self.loss.zero_()
        self.steps, self.samples, self.t0 = 0, 0, time.perf_counter()
        return rec


def say(is_main, text):
    if is_main:
        print(text, flush=True)


# ---------------------------------------------------------------- training
def train(args, rank, world_size, device, backend):
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0)  # torchrun's restart count
    is_main = rank == 0
    train_set, val_set, classes = build_data(args, rank)
    shape = tuple(train_set[0][0].shape)  # one input sample's shape, read from the data itself

    torch.manual_seed(args.seed)  # identical init on every rank (DDP also broadcasts rank 0's)
    raw_model = build_model(args, shape, classes).to(device)  # unwrapped: what checkpoints hold

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    val_loader = evaluation_loader(val_set, rank, world_size)
    batches_per_epoch = math.ceil(sampler.num_samples / args.batch_size)
    steps_per_epoch = batches_per_epoch  # one optimizer step per batch
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=args.lr, momentum=0.9)
    model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)

    metrics = Metrics(args.metrics_out, is_main, attempt)
    run_config = {**vars(args), "world_size": world_size}
    effective_batch = args.batch_size * world_size
    lr, total_steps = args.lr, args.epochs * steps_per_epoch
    say(is_main, f"world_size={world_size} backend={backend} device={device} "
        f"effective batch={args.batch_size} x {world_size} ranks "
        f"= {effective_batch}, lr={lr:g}, {steps_per_epoch} steps/epoch")
    metrics.write("config", **{**run_config, "backend": backend, "device": str(device)},
                  effective_batch=effective_batch, lr_effective=lr, steps_per_epoch=steps_per_epoch,
                  total_steps=total_steps)

    step, window = 0, Window(device)
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients across ranks here
            window.add(loss.detach(), len(y))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step, window.steps = step + 1, window.steps + 1
            if step % args.log_every == 0 or step == total_steps:
                rec = window.record(step=step, epoch=epoch)
                metrics.write("train", **rec)
                say(is_main, f"step {step} epoch {epoch} loss {rec['loss']:.4f} "
                    f"{rec['samples_per_s']:.0f} samples/s")
        with window.paused():  # after every epoch
            loss, acc, count = evaluate(raw_model, val_loader, device)
        metrics.write("eval", epoch=epoch, step=step, loss=loss, acc=acc, count=count)
        say(is_main, f"eval epoch {epoch} step {step}: loss {loss:.4f} acc {acc:.4f} ({count} samples)")
    metrics.write("final", step=step)
    dist.barrier()  # every rank is done with every collective before the group is torn down
    say(is_main, f"done: step {step}")


def main(argv=None):
    args = parse_args(argv)
    rank, world_size, device, backend = setup()
    try:
        train(args, rank, world_size, device, backend)
        # Seen with torch 2.14.1: train()'s frame (its DDP model, the gloo/NCCL state that holds)
        # can outlive its return. The first optimizer lazily imports torch._dynamo, and during that
        # import torch.fx.wrap keeps its own frame in a local: a reference cycle that pins every frame
        # then on the stack until Python's cycle collector runs. Freed only at interpreter exit, after
        # destroy_process_group, the model aborts a finished rank ("terminate called without an active
        # exception"). Collect it now, while the group still exists; the line is harmless on a torch
        # without the cycle, and can go once a model local to train() is freed when train() returns.
        gc.collect()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
