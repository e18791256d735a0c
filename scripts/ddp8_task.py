"""Rung 8 of the ladder: any task. Classification or regression, tuples or dict batches, models
called with keywords, a collate_fn: the loops stay as they are, and only call Task.

    python scripts/ddp8_task.py --dataset synthetic --task regression --epochs 1
    torchrun --standalone --nproc_per_node=2 scripts/ddp8_task.py --task classification

The task (--task classification | regression) is one class, Task: its targets, loss and metrics,
how a batch reaches the model; train_ddp.py, the next rung, adds every check of the data.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import gc
import json
import math
import os
import random
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset, default_collate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--dataset", default="digits", choices=["digits", "synthetic", "cifar10", "imagefolder"])
    a("--data-dir", default="data", help="cifar10 root, or an imagefolder with train/ and val/")
    a("--download", action="store_true", help="cifar10: download if missing (rank 0 only)")
    a("--synthetic-shape", default="3,32,32", help="synthetic: C,H,W of the random images")
    a("--synthetic-size", type=int, default=4096, help="synthetic: number of training samples")
    a("--task", default="classification", choices=["classification", "regression"], help="classification: "
      "class indices, cross-entropy, accuracy; regression: float32 targets shaped (N, outputs), MSE, RMSE")
    a("--model", default="mlp", choices=["mlp", "cnn", "resnet18", "wide_mlp"])
    a("--hidden", type=int, default=None, help="mlp width (64) / wide_mlp width (2048)")
    a("--batch-norm", action="store_true", help="cnn: add BatchNorm2d after each conv")
    a("--dropout", type=float, default=0.0, help="dropout after each hidden layer (mlp, cnn, resnet18 head)")
    a("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm (CUDA only)")
    a("--epochs", type=int, default=3)
    a("--max-steps", type=int, default=None, help="stop after this many optimizer steps "
      "(the LR schedule still spans --epochs, so a stopped run resumes exactly)")
    a("--batch-size", type=int, default=32, help="per rank, per micro-step")
    a("--accum-steps", type=int, default=1, help="micro-steps per optimizer step")
    a("--optimizer", default="sgd", choices=["sgd", "adamw"])
    a("--lr", type=float, default=0.05, help="for one process with --batch-size")
    a("--lr-scaling", default="none", choices=["none", "linear", "sqrt"],
      help="for a larger effective batch: linear (SGD; Goyal et al. 2017): lr x world_size x "
           "accum_steps; sqrt (Adam-family): lr x sqrt(world_size x accum_steps); use with warmup")
    a("--lr-schedule", default="cosine", choices=["cosine", "constant"])
    a("--warmup-epochs", type=float, default=0.0)
    a("--weight-decay", type=float, default=0.0)
    a("--seed", type=int, default=0)
    a("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    a("--clip-grad-norm", type=float, default=None, metavar="X",
      help="clip the global gradient norm to X, once per optimizer step (default: measure, never clip)")
    a("--ckpt-dir", default=None)
    a("--save-every", type=int, default=100, help="steps between checkpoints")
    a("--resume", default="auto", help="auto (D/last.pt if it exists) | PATH | none")
    a("--metrics-out", default=None, help="JSON lines file (appended, rank 0)")
    a("--log-every", type=int, default=50, help="steps between train records (each is a sync point)")
    a("--num-workers", type=int, default=0)
    a("--device", default="auto", choices=["auto", "cpu", "cuda"])
    a("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    a("--timeout", type=float, default=300.0, help="seconds for init and each collective")
    return p.parse_args(argv)


class UsageError(Exception):
    """Bad input: rank 0 prints one message, every rank exits with code 2, no traceback."""


def validate(args) -> None:
    """Checks that need nothing but the arguments: every rank reaches the same verdict."""
    for name in ("batch_size", "epochs", "accum_steps", "save_every", "log_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.max_steps is not None and args.max_steps < 1:
        raise UsageError(f"--max-steps must be at least 1 (got {args.max_steps})")
    if args.task == "regression" and args.dataset in ("digits", "cifar10", "imagefolder"):
        raise UsageError(f"--dataset {args.dataset} has class labels, not values to regress: use --task "
                         "classification, or --dataset synthetic (or your own data) with --task regression")
    if not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1) (got {args.dropout})")
    if args.lr <= 0:
        raise UsageError(f"--lr must be positive (got {args.lr})")
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:  # NaN fails this too
        raise UsageError(f"--clip-grad-norm must be positive (got {args.clip_grad_norm})")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda = pick_device(args.device, args.backend, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), gpus)[0] == "cuda"
    if args.sync_bn and not cuda:
        raise UsageError("--sync-bn needs CUDA (SyncBatchNorm has no CPU kernel): drop --sync-bn on CPU; "
                         "each rank then normalises with its own batch's statistics (DDP's buffer broadcast "
                         "only equalises the running averages), so keep the per-rank batch large enough")
    if args.dataset == "imagefolder":
        for split in ("train", "val"):
            if not os.path.isdir(os.path.join(args.data_dir, split)):
                raise UsageError(f"--data-dir {args.data_dir!r} has no {split}/ folder: imagefolder "
                                 "expects DATA_DIR/train/CLASS/*.jpg and DATA_DIR/val/CLASS/*.jpg")
    if args.precision == "fp16" and not cuda and int(os.environ.get("RANK", 0)) == 0:
        print("warning: --precision fp16 on a CPU is very slow (about 60x slower than fp32 here); "
              "use --precision bf16 on CPU", file=sys.stderr, flush=True)


def agree(error: str | None) -> None:
    """Every rank calls this; if any rank found a problem, all raise the same UsageError."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise UsageError(first)


# ---------------------------------------------------------------- distributed setup
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(device: str, backend: str, local_world_size: int, gpus: int) -> tuple[str, str]:
    """("cuda" or "cpu", backend) for one process of local_world_size on a node with `gpus` GPUs.

    NCCL needs a GPU of its own for every process on the node (two ranks on one GPU fail with
    "Duplicate GPU detected"), so --device auto falls back to the CPU with gloo when there are
    fewer GPUs than processes, and --device cuda / --backend nccl refuse with the fix.
    (ddp_lab.engine.runtime.pick_backend makes the same decision.)
    """
    too_few = (f"{local_world_size} processes on this node but {gpus} GPU(s): NCCL needs one GPU per "
               f"process; start --nproc_per_node={max(gpus, 1)} or use --device cpu")
    if device == "cuda" and gpus == 0:
        raise UsageError("--device cuda but no CUDA device is visible: use --device auto or cpu")
    if device == "cuda" and gpus < local_world_size:
        raise UsageError(too_few)
    use_cuda = device == "cuda" or (device == "auto" and gpus >= local_world_size and gpus > 0)
    if backend == "nccl" and not use_cuda:
        raise UsageError(too_few if gpus else "--backend nccl needs CUDA GPUs: use --backend gloo on the CPU")
    return ("cuda" if use_cuda else "cpu"), (backend if backend != "auto" else ("nccl" if use_cuda else "gloo"))


def setup(args):
    """Join torchrun's group, or make a world of one so the same code runs unlaunched."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # picks the GPU; the global rank shards data
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device_type, backend = pick_device(args.device, args.backend, local_world_size, gpus)
    if device_type == "cuda":  # before init, so NCCL binds each process to its own GPU, not all to GPU 0
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    # NCCL binds this GPU at init (without device_id every barrier() warns it is guessing the GPU)
    device_id = device if device.type == "cuda" else None
    timeout = datetime.timedelta(seconds=args.timeout)  # a lost rank fails loudly, never hangs
    if "RANK" in os.environ:
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps this store across restarts: a fresh key space per attempt, or
            # restarted workers may read the dead workers' addresses and fail to connect. (Elastic
            # jobs that nodes join: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a new store every round.)
            store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device_id)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1, timeout=timeout, device_id=device_id)
    return rank, world_size, local_rank, device, backend


# ---------------------------------------------------------------- data
def load_digits_split():
    """scikit-learn's bundled digits: the same seeded split as the workbook (297 val, 1500 train)."""
    try:
        from sklearn.datasets import load_digits  # lazy: the only non-torch import, digits only
    except ImportError:
        raise UsageError("--dataset digits needs scikit-learn: pip install scikit-learn, or use --dataset synthetic") from None

    d = load_digits()
    X = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    X, y = X[order], y[order]
    return TensorDataset(X[297:], y[297:]), TensorDataset(X[:297], y[:297]), 10


def build_data(args, rank):
    """(train set, validation set, model outputs); each sample is (input, target) as Task describes."""
    if args.dataset == "digits":
        return load_digits_split()
    if args.dataset == "synthetic":
        shape = tuple(int(s) for s in args.synthetic_shape.split(","))
        g = torch.Generator().manual_seed(1234)  # same data on every rank, unrelated to --seed
        n, n_val = args.synthetic_size, max(1, args.synthetic_size // 8)
        X = torch.randn(n + n_val, *shape, generator=g)
        if args.task == "classification":
            y = torch.randint(0, 10, (n + n_val,), generator=g)
            return TensorDataset(X[:n], y[:n]), TensorDataset(X[n:], y[n:]), 10
        w = torch.randn(math.prod(shape), generator=g) / math.prod(shape) ** 0.5
        y = 40 + 8 * X.flatten(1) @ w + torch.randn(n + n_val, generator=g)  # in its own units: mean 40, std 8
        y = ((y - y[:n].mean()) / y[:n].std()).reshape(-1, 1)  # standardised by the training part; (N, 1)
        return TensorDataset(X[:n], y[:n]), TensorDataset(X[n:], y[n:]), 1
    import torchvision.transforms as T  # lazy: importing torchvision costs seconds
    from torchvision import datasets

    if args.dataset == "cifar10":
        norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
        train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
        failed = None
        if args.download and rank == 0:  # one download, not one per rank racing on the same files
            try:
                datasets.CIFAR10(args.data_dir, train=True, download=True)
                datasets.CIFAR10(args.data_dir, train=False, download=True)
            except OSError as e:  # urllib's URLError is an OSError: no network, no name resolution
                failed = (f"--download could not fetch CIFAR-10 ({e}): this node cannot reach the network. Download "
                          "where it can and copy cifar-10-batches-py into --data-dir (from a notebook: launch.torchrun("
                          "..., network=True); launches otherwise run in a private, loopback-only namespace)")
        agree(failed)  # every rank waits here, as at a barrier, and all stop with rank 0's message
        try:
            train = datasets.CIFAR10(args.data_dir, train=True, transform=train_tf)
            val = datasets.CIFAR10(args.data_dir, train=False, transform=T.Compose([T.ToTensor(), norm]))
        except RuntimeError:  # torchvision checks every file's md5: missing and corrupt look alike
            raise UsageError(
                f"CIFAR-10 not found or corrupted under --data-dir {args.data_dir!r} (torchvision checks "
                "each file's md5): point --data-dir at the folder holding cifar-10-batches-py, or delete "
                "that folder and add --download to fetch it again") from None
        return train, val, 10
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    folders = {split: os.path.join(args.data_dir, split) for split in ("train", "val")}
    try:
        train = datasets.ImageFolder(folders["train"], T.Compose(
            [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
        val = datasets.ImageFolder(folders["val"], T.Compose(
            [T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    except FileNotFoundError as e:  # no class folders, or class folders without images
        raise UsageError(f"imagefolder: {e}; expected DATA_DIR/train/CLASS/*.jpg and "
                         "DATA_DIR/val/CLASS/*.jpg") from None
    if train.classes != val.classes:  # labels are class indices: a missing class shifts all after it
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise UsageError(f"imagefolder: train/ and val/ must hold the same class folders (labels are "
                         f"their sorted order); only in train/: {only_train or 'none'}, only in val/: "
                         f"{only_val or 'none'}")
    return train, val, len(train.classes)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start mid-epoch, on any number of ranks: it skips the first
    `start` samples of the epoch's shuffled order (the same order for every world size) and
    shards the rest, so a resume with more or fewer ranks neither repeats nor skips a sample."""

    start = 0  # samples of this epoch's order already used, by all ranks together (set before iterating)

    def __iter__(self):
        n = len(self.dataset)
        g = torch.Generator().manual_seed(self.seed + self.epoch)  # DistributedSampler's own order
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        rest = order[self.start:]
        rest += order[:-len(rest) % self.num_replicas]  # pad as DistributedSampler does: equal shards
        return iter(rest[self.rank::self.num_replicas])

    def __len__(self):
        return max(0, math.ceil((len(self.dataset) - self.start) / self.num_replicas))


# ---------------------------------------------------------------- the task: targets, loss, metrics
class Task:
    """What the model learns and how a batch reaches it. A sample is (input, target), or a dict whose
    "labels" entry is the target and whose other entries are the model's keyword arguments."""

    collate_fn = None  # how samples become a batch, in both loaders; None: torch's default_collate
    labels = "labels"  # a dict sample's target

    def __init__(self, kind: str, outputs: int):
        self.kind, self.outputs, self.shape = kind, outputs, None

    def to_device(self, batch, device):
        """Every tensor of the batch on `device`, in tuples (named ones too), lists and dicts alike."""
        if isinstance(batch, dict):
            return {k: self.to_device(v, device) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            moved = [self.to_device(v, device) for v in batch]
            return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
        return batch.to(device, non_blocking=True) if torch.is_tensor(batch) else batch

    def inputs(self, batch):
        return {k: v for k, v in batch.items() if k != self.labels} if isinstance(batch, dict) else batch[0]

    def target(self, batch):
        return batch[self.labels] if isinstance(batch, dict) else batch[1]

    def forward(self, model, batch):
        """The model's output for a batch: called with a dict's entries as keywords, else with the input."""
        x = self.inputs(batch)
        return model(**x) if isinstance(x, dict) else model(x)

    def batch(self, dataset, n):
        return (self.collate_fn or default_collate)([dataset[i] for i in range(min(n, len(dataset)))])

    def loss(self, out, y, reduction="mean"):
        if self.kind == "classification":  # (B, classes) against (B,), or (B, T, classes) against (B, T)
            return F.cross_entropy(out.flatten(0, -2), y.flatten(), reduction=reduction)
        return F.mse_loss(out, y, reduction=reduction)

    def sums(self, out, y):
        """One evaluation batch, summed (any number of sums: evaluate all-reduces what this returns).
        classification: [loss sum, correct, targets, samples]; regression: [loss sum, target values, samples]."""
        middle = [y.numel()]
        if self.kind == "classification":
            counted = y != -100  # cross_entropy's ignore_index: padding counts nowhere
            middle = [((out.argmax(-1) == y) & counted).sum(), counted.sum()]
        sums = [self.loss(out, y, reduction="sum"), *middle, len(y)]
        return torch.stack([torch.as_tensor(s, device=out.device).double() for s in sums])

    def metrics(self, stats) -> dict:
        """From the sums of every rank (all-reduced): RMSE is the square root of the global mean
        squared error, never a mean of each rank's RMSE."""
        if self.kind == "classification":
            total, correct, targets, count = stats.tolist()
            return {"loss": total / targets, "acc": correct / targets, "count": int(count)}
        total, values, count = stats.tolist()
        return {"loss": total / values, "rmse": math.sqrt(total / values), "count": int(count)}

    def describe(self, scores) -> str:
        return " ".join(f"{k} {v:.4f}" for k, v in scores.items() if k != "count") + f" ({scores['count']} samples)"

    def check_data(self, splits: dict, world_size: int) -> str | None:
        """The one-line fix when a split cannot train or be evaluated, else None; sets self.shape."""
        for name, data in splits.items():
            if len(data) < (1 if name == "training" else world_size):  # every rank evaluates at least one
                return (f"the {name} set has {len(data)} sample(s){f' for {world_size} ranks' * bool(len(data))}: "
                        f"build_data must return at least {1 if name == 'training' else world_size}; check its "
                        "path and split, or hold out more samples")
            if problem := self.check_split(name, data):
                return problem
        return None

    def check_split(self, name, data) -> str | None:  # train_ddp.py checks targets, NaN, shapes too
        first = self.inputs(self.batch(data, 1))
        if name == "training":
            self.shape = (tuple((k, *v.shape[1:]) for k, v in first.items()) if isinstance(first, dict)
                          else tuple(first.shape[1:]))  # one sample's shape, read from the data itself
        for t in first.values() if isinstance(first, dict) else [first]:
            if torch.is_tensor(t) and t.is_floating_point() and t.dtype != torch.float32:  # numpy's float64
                return (f"the inputs are {t.dtype}, the model float32: build the dataset from "
                        "torch.tensor(X, dtype=torch.float32)")
        return None


# ---------------------------------------------------------------- model
def mlp_width(args) -> int:
    return args.hidden or (64 if args.model == "mlp" else 2048)


def build_model(args, shape, classes):
    """shape: one input sample's shape. The MLPs flatten any shape; cnn and resnet18 need (C, H, W)."""
    if args.model in ("mlp", "wide_mlp"):  # same layers as ddp_lab.lessons.models.mlp / wide_mlp
        width, depth = mlp_width(args), 1 if args.model == "mlp" else 3
        layers, d = [nn.Flatten()], math.prod(shape)
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.ReLU()] + ([nn.Dropout(args.dropout)] if args.dropout else [])
            d = width
        return nn.Sequential(*layers, nn.Linear(d, classes))
    if len(shape) != 3:
        raise UsageError(f"--model {args.model} needs image samples shaped (channels, height, width); "
                         f"this dataset's samples are shaped {tuple(shape)}: use --model mlp")
    c, h, w = shape
    if args.model == "cnn":  # same layers (and state_dict keys) as ddp_lab.lessons.models.cnn
        norm = nn.BatchNorm2d if args.batch_norm else (lambda ch: nn.Identity())
        return nn.Sequential(
            nn.Conv2d(c, 32, 3, padding=1), norm(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), norm(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * (h // 2) * (w // 2), 128), nn.ReLU(),
            *([nn.Dropout(args.dropout)] if args.dropout else []), nn.Linear(128, classes))
    import torchvision  # lazy

    model = torchvision.models.resnet18(weights=None, num_classes=classes)
    if c != 3 or h < 64:  # small images: a 3x3 stem without the max-pool keeps spatial detail
        model.conv1 = nn.Conv2d(c, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    if args.dropout:
        model.fc = nn.Sequential(nn.Dropout(args.dropout), model.fc)
    return model


# ---------------------------------------------------------------- checkpoints and metrics
def os_error_in(e: BaseException) -> OSError | None:
    """The OSError behind an exception: torch.save wraps a failed write in a RuntimeError."""
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__ or e.__context__
    return e


def describe_write_error(e: BaseException) -> str:
    os_err = os_error_in(e)
    if os_err is not None and os_err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on device"
    if os_err is not None and os_err.errno == errno.EFBIG:
        return "file too large (a file-size limit, see ulimit -f)"
    return os_err.strerror if os_err is not None and os_err.strerror else f"{type(e).__name__}: {e}"


def atomic_save(path: str, state: dict) -> None:
    """Temp file in the same folder, fsync, then rename: a kill or a full disk leaves last.pt intact."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:  # a file object, so a failed write keeps its OSError (errno)
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX and Windows: readers see the old or the new file
        if hasattr(os, "O_DIRECTORY"):  # and the rename itself survives a power cut (POSIX)
            fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # never leave a half-written file behind
        raise


def check_writable(folder: str) -> str | None:
    probe = os.path.join(folder, f".write_probe_{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        full = os_error_in(e).errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        return (f"--ckpt-dir {folder!r} is not writable ({describe_write_error(e)}): "
                + ("free space, or " if full else "") + "choose a folder you can write, or drop --ckpt-dir")
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    return None


# What a checkpoint's tensors depend on: resuming with any of these changed is refused, naming it.
SPEC_FLAGS = {"model": "--model", "width": "--hidden", "batch_norm": "--batch-norm", "dropout": "--dropout",
              "dataset": "--dataset", "train_samples": "training samples", "classes": "classes",
              "input_shape": "input shape", "task": "--task"}


def run_spec(args, train_set, classes, shape) -> dict:
    width = mlp_width(args) if args.model in ("mlp", "wide_mlp") else None
    return {"model": args.model, "width": width, "batch_norm": args.batch_norm, "dropout": args.dropout,
            "dataset": args.dataset, "train_samples": len(train_set), "classes": classes,
            "input_shape": list(shape), "task": args.task}


def read_checkpoint(path: str, spec: dict):
    """(checkpoint, None) or (None, the one-line reason it cannot be resumed)."""
    try:  # weights_only: a checkpoint is data, never code to run
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        return None, f"cannot read checkpoint {path!r} ({type(e).__name__}): delete it or pass --resume none"
    if not isinstance(ckpt, dict) or not {"model", "optimizer", "step"} <= ckpt.keys():
        return None, f"{path!r} is not a train_ddp.py checkpoint: pass another --ckpt-dir or --resume none"
    if "spec" not in ckpt or "samples_in_epoch" not in ckpt or not isinstance(ckpt.get("rng"), list):
        return None, (f"{path!r} was written by an older train_ddp.py, which did not record what the model "
                      "and data were: pass --resume none to start over, or another --ckpt-dir")
    differ = [k for k, v in spec.items() if ckpt["spec"].get(k) != v]
    if differ:
        old = ", ".join(f"{SPEC_FLAGS[k]} {ckpt['spec'].get(k)}" for k in differ)
        new = ", ".join(f"{SPEC_FLAGS[k]} {spec[k]}" for k in differ)
        return None, (f"checkpoint {path!r} does not fit this run: it was written with {old}, this run has "
                      f"{new}; use the same settings, another --ckpt-dir, or --resume none to start over "
                      "(this run would then replace it)")
    return ckpt, None


def file_fingerprint(path: str):
    """(size, mtime in ns) of the file at `path` as this rank sees it; None if it sees no file."""
    if not os.path.isfile(path):
        return None
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def resume_state(args, rank: int, spec: dict, device):
    """(checkpoint or None, path, who read it) on every rank. Rank 0 finds the file and sends its
    path, size and mtime. If every rank sees that same file (shared storage; one small all_reduce
    decides), each reads it itself to the CPU: nothing big crosses the network or the GPU. Else
    rank 0 reads it and broadcasts it, so nodes without a shared filesystem resume too. Either way
    every rank reaches the same verdict. The checkpoint is rank 0's save: every rank needs all of it."""
    box = [None, None]  # path, its fingerprint on rank 0
    if rank == 0:
        path = args.resume if args.resume not in ("auto", "none") else None
        auto = os.path.join(args.ckpt_dir, "last.pt") if args.ckpt_dir else None
        if args.resume == "auto" and auto and os.path.isfile(auto):
            path = auto
        box = [path, file_fingerprint(path) if path else None]
    dist.broadcast_object_list(box, src=0)
    path, mark = box
    if path and mark is None:
        raise UsageError(f"--resume {path!r}: no such file (use auto, none or a checkpoint path)")
    if path is None:
        return None, None, None
    seen = torch.tensor([int(file_fingerprint(path) == mark)], device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)  # 1: every rank sees rank 0's file
    if rank == 0:
        print(f"resume: every rank reads {path} itself (shared storage)" if seen.item() else
              f"resume: rank 0 reads {path} and sends it (other ranks cannot see the file)")
    if seen.item():
        ckpt, err = read_checkpoint(path, spec)
        agree(err)  # a file one rank cannot use stops every rank, with the same message
        return ckpt, path, "every rank"
    box = list(read_checkpoint(path, spec)) if rank == 0 else [None, None]  # checkpoint, error
    dist.broadcast_object_list(box, src=0)
    if box[1]:
        raise UsageError(box[1])
    return box[0], path, "rank 0"


def rng_state(device) -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None}


def set_rng_state(state: dict, device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu())


def rank_seed(seed: int, rank: int) -> int:
    """Each rank's own random stream (dropout, augmentation), distinct from the init stream."""
    return seed + 1_000_003 * (rank + 1)


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
def build_optimizer(args, model, world_size, steps_per_epoch):
    """SGD or AdamW at the rate for this effective batch, and its schedule: linear warmup, then
    constant or cosine down to 0 after --epochs (--max-steps only stops early, so a run stopped
    there resumes exactly)."""
    growth = world_size * args.accum_steps  # how many times larger the effective batch is
    lr = args.lr * {"none": 1, "linear": growth, "sqrt": math.sqrt(growth)}[args.lr_scaling]
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    total, warmup = args.epochs * steps_per_epoch, int(args.warmup_epochs * steps_per_epoch)

    def lr_factor(s):
        if s < warmup:
            return (s + 1) / warmup
        if args.lr_schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, total - warmup))))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def resume(args, rank, world_size, spec, stateful, device, steps_per_epoch):
    """Load the checkpoint --resume names (if any) into `stateful` (model, optimizer, scheduler,
    scaler); returns (epoch, samples_in_epoch, step) to continue from, the checkpoint's path, and
    who read it ("every rank" or "rank 0")."""
    ckpt, path, reader = resume_state(args, rank, spec, device)
    if ckpt is None:
        return (0, 0, 0), None, None
    scheduler = stateful["scheduler"]
    base_lrs = list(scheduler.base_lrs)  # this layout's, before the checkpoint's replace them
    for name, obj in stateful.items():
        try:
            obj.load_state_dict(ckpt[name])
        except (RuntimeError, ValueError, KeyError):  # same settings, other tensors: edited, or another version
            raise UsageError(f"checkpoint {path!r} does not fit this run's {name}: use another --ckpt-dir "
                             "or --resume none") from None
    epoch, samples_in_epoch, step = ckpt["epoch"], ckpt["samples_in_epoch"], ckpt["step"]
    same_layout = all(ckpt["config"].get(k) == v for k, v in (
        ("world_size", world_size), ("batch_size", args.batch_size), ("accum_steps", args.accum_steps)))
    if not same_layout:  # the position is global: it holds for any layout. A step's size changed, so
        # the schedule follows the data (its step for this position), at this layout's rate
        scheduler.base_lrs = base_lrs
        scheduler.last_epoch = epoch * steps_per_epoch + samples_in_epoch // (
            args.batch_size * world_size * args.accum_steps)
        for group, base, factor in zip(stateful["optimizer"].param_groups, base_lrs, scheduler.lr_lambdas):
            group["initial_lr"], group["lr"] = base, base * factor(scheduler.last_epoch)
        if rank == 0:
            print(f"resume: world size / batch size / accumulation changed; epoch {epoch} continues at "
                  f"sample {samples_in_epoch} of its shuffled order")
            print(f"resume: the learning-rate schedule continues at its step {scheduler.last_epoch} of this layout")
    if len(ckpt["rng"]) == world_size:  # every rank continues its own random stream
        set_rng_state(ckpt["rng"][rank], device)
    return (epoch, samples_in_epoch, step), path, reader


def save_checkpoint(path, stateful, position, spec, config, device, saved_step):
    """Every rank calls it (each adds its random state); rank 0 writes `path` atomically. A failed
    write stops every rank with one message saying what `path` still holds (the checkpoint of
    saved_step, if any)."""
    epoch, samples_in_epoch, step = position
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng_state(device))  # every rank's random stream, for an exact resume
    err = None
    if dist.get_rank() == 0:
        try:
            atomic_save(path, {**{name: obj.state_dict() for name, obj in stateful.items()},
                               "epoch": epoch, "samples_in_epoch": samples_in_epoch, "step": step,
                               "rng": rngs, "spec": spec, "config": config})
        except (OSError, RuntimeError) as e:  # torch.save wraps a failed write in a RuntimeError
            if os_error_in(e) is None:
                raise
            kept = (f"last.pt is still the step-{saved_step} checkpoint" if saved_step is not None
                    else "last.pt was left as it was" if os.path.exists(path) else "nothing was written")
            err = (f"{describe_write_error(e)} while saving {path} at step {step}; the temporary file "
                   f"was removed and {kept}: free space or choose another --ckpt-dir, then run again")
    agree(err)  # nobody runs ahead (or exits) before the checkpoint is complete, or all stop


def evaluation_loader(val_set, rank, world_size, num_workers, collate_fn=None):
    """Every validation sample on exactly one rank (rank, rank + world_size, ...): no padding
    copies, which DistributedSampler adds to even out shards and which would count twice."""
    return DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=256,
                      num_workers=num_workers, persistent_workers=num_workers > 0, collate_fn=collate_fn)


def evaluate(model, loader, device, amp_dtype, task):
    """The task's metrics over the whole validation set: {loss, acc or rmse, count}. `model` is the
    unwrapped model: ranks may hold different numbers of batches here, and DDP's forward expects them equal."""
    model.eval()
    stats = 0  # Task.sums of every batch: as many sums as the first batch returns (every rank has one)
    with torch.no_grad(), autocast(device, amp_dtype):
        for batch in loader:
            batch = task.to_device(batch, device)
            stats = stats + task.sums(task.forward(model, batch).float(), task.target(batch))
    dist.all_reduce(stats)  # global sums, not rank 0's shard: the metrics come from these
    model.train()
    return task.metrics(stats)


def sync_buffers(model):
    """Rank 0's buffers (BatchNorm running statistics) on every rank, as DDP's next forward would
    broadcast them: each rank's last forward updated its own, so without this every rank would
    evaluate a slightly different model. One broadcast per buffer; none for a model without any."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def optimizer_step(optimizer, scaler, params, max_norm):
    """Clip to max_norm (None: measure only) and step; returns (global gradient norm before
    clipping, whether the step was skipped). After DDP's all-reduce every rank holds the same
    gradients, so the norm and the skip are the same on every rank with no extra collective. A NaN
    or inf on any rank reaches every rank's gradients: the step is skipped everywhere (the scaler
    does it itself with fp16, lowering its scale); the step count and the schedule still advance."""
    scaler.unscale_(optimizer)  # fp16: clip the true gradients, not the scaled ones (else a no-op)
    norm = nn.utils.clip_grad_norm_(params, max_norm or math.inf)  # inf: gradients x 1.0, unchanged
    skipped = not torch.isfinite(norm).item()  # one host sync per step, as GradScaler.step's own
    if scaler.is_enabled() or not skipped:
        scaler.step(optimizer)  # skips by itself when unscale_ found inf/NaN: never twice
    scaler.update()
    return norm, skipped


def autocast(device, amp_dtype):
    """bf16/fp16 autocast, or no context at all for fp32 (a disabled autocast still costs time)."""
    return torch.autocast(device.type, amp_dtype) if amp_dtype else contextlib.nullcontext()


def is_sync_step(i: int, accum_steps: int, batches_per_epoch: int) -> bool:
    """Batch i (0-based, in the epoch) ends an accumulation group: all-reduce, then step. The
    epoch's last batch always ends one, so a short tail group still steps."""
    return (i + 1) % accum_steps == 0 or i + 1 == batches_per_epoch


def group_size(i: int, accum_steps: int, batches_per_epoch: int) -> int:
    """Micro-batches in batch i's group: accum_steps, or fewer in the epoch's short tail."""
    return min(accum_steps, batches_per_epoch - (i - i % accum_steps))


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


def fit_batch(args, n, world_size, is_main) -> None:
    """Cap --batch-size at one rank's share of the n training samples: a larger batch only ever
    trains batches of that share, so the effective batch and any LR scaling must use the share."""
    share = math.ceil(n / world_size)
    if args.batch_size > share:
        if is_main:
            print(f"warning: --batch-size {args.batch_size} is more than a rank's share of the data "
                  f"({n} samples / {world_size} ranks): each rank trains batches of {share}, and this run "
                  f"uses --batch-size {share}", file=sys.stderr, flush=True)
        args.batch_size = share


def check_start(args, world_size, train_set, is_main) -> str | None:
    """What only the data and the filesystem reveal, found before the first step."""
    if world_size > len(train_set):
        return (f"{world_size} ranks but only {len(train_set)} training samples: every rank needs at "
                "least one; use fewer processes (--nproc_per_node) or more data")
    return check_writable(args.ckpt_dir) if args.ckpt_dir and is_main else None


def say(is_main, text):
    if is_main:
        print(text, flush=True)


# ---------------------------------------------------------------- training
def steps_left(n, epoch, position, args, world_size):
    """Optimizer steps from sample `position` of epoch `epoch` to the end of the last epoch, in this
    layout. Steps are counted globally, but their size depends on the world size: a run resumed on
    another one must end where its data does, not at this layout's step count."""
    steps = lambda used: math.ceil(math.ceil(math.ceil((n - used) / world_size) / args.batch_size)
                               / args.accum_steps)
    return 0 if epoch >= args.epochs else steps(position) + (args.epochs - epoch - 1) * steps(0)


def train(args, rank, world_size, device, backend):
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0)  # torchrun's restart count
    is_main = rank == 0
    train_set, val_set, outputs = build_data(args, rank)
    task = Task(args.task, outputs)  # the targets, the loss, the metrics, and how a batch reaches the model
    data_problem = task.check_data({"training": train_set, "validation": val_set}, world_size)
    agree(check_start(args, world_size, train_set, is_main) or data_problem)
    shape = task.shape  # one input sample's shape, read from the data itself
    fit_batch(args, len(train_set), world_size, is_main)  # before anything derives from the batch size

    torch.manual_seed(args.seed)  # identical init on every rank (DDP also broadcasts rank 0's)
    random.seed(args.seed)
    raw_model = build_model(args, shape, outputs).to(device)  # unwrapped: what checkpoints hold
    if args.sync_bn:
        raw_model = nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    # From here on each rank draws its own dropout masks and augmentations (the same stream on
    # every rank would make N ranks see N copies of one random view of their data).
    torch.manual_seed(rank_seed(args.seed, rank))
    random.seed(rank_seed(args.seed, rank))
    spec = run_spec(args, train_set, outputs, shape)

    sampler = ResumableSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader_rng = torch.Generator()  # seeds the DataLoader workers (per rank, below)
    # persistent: one set of workers serves every epoch, not new processes (each with its setup) per epoch
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        persistent_workers=args.num_workers > 0, pin_memory=device.type == "cuda", generator=loader_rng,
                        collate_fn=task.collate_fn)
    val_loader = evaluation_loader(val_set, rank, world_size, args.num_workers, task.collate_fn)
    batches_per_epoch = math.ceil(sampler.num_samples / args.batch_size)
    steps_per_epoch = math.ceil(batches_per_epoch / args.accum_steps)
    optimizer, scheduler = build_optimizer(args, raw_model, world_size, steps_per_epoch)
    # fp16 needs loss scaling (its small range underflows gradients); bf16 has fp32's range.
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    stateful = {"model": raw_model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    # Resume before DDP wraps the model: DDP broadcasts rank 0's weights at construction.
    (epoch, position, step), resumed, reader = resume(args, rank, world_size, spec, stateful, device, steps_per_epoch)
    model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)

    metrics = Metrics(args.metrics_out, is_main, attempt)
    run_config = {**vars(args), "world_size": world_size}  # what checkpoints record of this run
    effective_batch = args.batch_size * world_size * args.accum_steps
    lr, total_steps = optimizer.param_groups[0]["initial_lr"], args.epochs * steps_per_epoch
    say(is_main, f"world_size={world_size} backend={backend} device={device} model={args.model} "
        f"effective batch={args.batch_size} x {world_size} ranks x {args.accum_steps} accum "
        f"= {effective_batch}, lr={lr:g}, {steps_per_epoch} steps/epoch")
    metrics.write("config", **{**run_config, "backend": backend, "device": str(device)},
                  effective_batch=effective_batch, lr_effective=lr, steps_per_epoch=steps_per_epoch,
                  total_steps=total_steps)
    if resumed:
        metrics.write("resume", step=step, epoch=epoch, path=resumed, read_by=reader)
        say(is_main, f"resumed from {resumed} at step {step} (epoch {epoch}, sample {position})")

    last_pt = os.path.join(args.ckpt_dir, "last.pt") if args.ckpt_dir else None
    saved_step = step if resumed and resumed == last_pt else None  # the step last.pt holds
    end = step + steps_left(len(train_set), epoch, position, args, world_size)  # where the data ends
    max_steps = args.max_steps or end
    per_batch = args.batch_size * world_size  # samples all ranks use per batch
    window = Window(device)
    loader_rng.manual_seed(rank_seed(args.seed, rank) + epoch)  # workers' seeds, once: the workers persist
    model.train()
    while epoch < args.epochs and step < max_steps:
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        sampler.start = position  # samples of this epoch's order already used, by all ranks together
        batches, i = math.ceil(len(sampler) / args.batch_size), 0  # this rank's batches left in the epoch
        for batch in loader:
            batch = task.to_device(batch, device)
            y = task.target(batch)
            sync = is_sync_step(i, args.accum_steps, batches)
            with contextlib.nullcontext() if sync else model.no_sync():  # all-reduce once per group
                with autocast(device, amp_dtype):
                    loss = task.loss(task.forward(model, batch), y) / group_size(i, args.accum_steps, batches)
                scaler.scale(loss).backward()  # the loss is the group's mean: / group_size above
            window.add(loss.detach(), len(y))
            i += 1
            if not sync:
                continue
            lr_used = optimizer.param_groups[0]["lr"]  # this step's rate (the scheduler then sets the next)
            grad_norm, skipped = optimizer_step(optimizer, scaler, raw_model.parameters(), args.clip_grad_norm)
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step, window.steps = step + 1, window.steps + 1
            if step % args.log_every == 0 or step == max_steps or skipped:  # a skip is always recorded
                rec = window.record(step=step, epoch=epoch, lr=lr_used, grad_norm=grad_norm.item(), skipped=skipped)
                metrics.write("train", **rec)
                say(is_main, f"step {step} epoch {epoch} loss {rec['loss']:.4f} lr {lr_used:.4g} "
                    f"{rec['samples_per_s']:.0f} samples/s" + (" (skipped: non-finite gradients)" if skipped else ""))
            if last_pt and step % args.save_every == 0:
                save_checkpoint(last_pt, stateful, (epoch, position + i * per_batch, step), spec, run_config, device, saved_step)
                saved_step = step
                metrics.write("ckpt", step=step, path=last_pt)
            if step >= max_steps:
                break
        with window.paused():  # after every epoch, and where --max-steps stopped mid-epoch
            sync_buffers(raw_model)  # every rank evaluates the same model
            scores = evaluate(raw_model, val_loader, device, amp_dtype, task)
        metrics.write("eval", epoch=epoch, step=step, **scores)
        say(is_main, f"eval epoch {epoch} step {step}: {task.describe(scores)}")
        epoch, position = (epoch + 1, 0) if i >= batches else (epoch, position + i * per_batch)
    if last_pt and saved_step != step:
        save_checkpoint(last_pt, stateful, (epoch, position, step), spec, run_config, device, saved_step)
        metrics.write("ckpt", step=step, path=last_pt)
    metrics.write("final", step=step)
    dist.barrier()  # every rank is done with every collective before the group is torn down
    say(is_main, f"done: step {step}")


def main(argv=None):
    args = parse_args(argv)
    try:
        validate(args)
        rank, world_size, _, device, backend = setup(args)
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
    except UsageError as e:
        rank = int(os.environ.get("RANK", 0))
        if rank != 0:  # one message, rank 0's (every rank reaches the same verdict): torchrun stops the
            time.sleep(30)  # others once rank 0 exits, so none can exit first and cut rank 0's line off
        # past the wait, only a rank with an error of its own, which rank 0 did not report
        print(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
