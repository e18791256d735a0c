"""Train a classifier (or a regression model) with DistributedDataParallel: one file, 1 CPU to N GPUs on N nodes.

Run recipe (the same file, unchanged, in every setting):

    # one process (world size 1; CPU or one GPU)
    python scripts/train_ddp.py --epochs 3 --metrics-out runs/m.jsonl

    # N processes on this machine (N GPUs, or N CPU processes over gloo)
    torchrun --standalone --nproc_per_node=4 scripts/train_ddp.py --ckpt-dir runs/ckpt

    # two nodes, 8 GPUs each: run this on both, NODE_RANK=0 on the head node, 1 on the other
    torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=8 \
        --master_addr=HEAD_HOSTNAME --master_port=29500 \
        scripts/train_ddp.py --dataset imagefolder --data-dir /data/imagenet --model resnet18

    # SLURM: sbatch scripts/slurm_ddp.sbatch   (one torchrun per node, see that file)

    # survive a crash: torchrun restarts the workers, --resume auto continues from last.pt
    torchrun --standalone --nproc_per_node=2 --max-restarts=1 scripts/train_ddp.py \
        --ckpt-dir runs/ckpt --save-every 10 --crash-at-step 15

    # sharded checkpoints: every rank writes its part of runs/ckpt/last.dcp/ (storage all ranks see)
    torchrun --standalone --nproc_per_node=4 scripts/train_ddp.py --ckpt-dir runs/ckpt --ckpt-format dcp

What it gets right (each one a classic DDP bug when missing):
- backend from the device (nccl with a GPU per process, else gloo), a timeout on init and every
  collective;
- the global rank shards data, the local rank picks the GPU (they differ on multi-node);
- the same seed for the initial weights, then each rank its own random stream (dropout,
  augmentation); DistributedSampler.set_epoch every epoch;
- gradient accumulation with no_sync() on every micro-step but the last;
- losses, accuracy and RMSE from sums all-reduced before printing (not rank 0's own numbers);
- evaluation counts every validation sample exactly once (no sampler padding);
- rank 0 saves the full training state (every rank's random state too) atomically: temp file,
  then rename; on resume each rank reads it if all see it, else rank 0 reads and broadcasts it
  (--ckpt-format dcp: every rank writes its part of a folder, renamed into place when complete);
- resume continues mid-epoch at the exact batch, so crash + restart == uninterrupted run;
- the DDP model is released before the process group is destroyed (see main()).

The task (--task classification | regression) is one class, Task: its targets, loss and metrics,
how a batch reaches the model (tuples or dicts, keyword models, a collate_fn), and the data's checks.

Metrics (--metrics-out, JSON lines appended by rank 0, each with "kind" and "attempt"):
config, train, eval, ckpt, resume, final. --profile-steps A:B writes a torch.profiler trace of
those steps per rank. See docs/train_ddp.md.

This file is the last rung of a ladder: minimal_ddp.py, then ddp2_metrics.py ... ddp8_task.py
beside it, each a small diff of the one before (notebook 06b shows the diffs).
Needs only torch 2.4 or newer (torchvision for resnet18/cifar10/imagefolder; scikit-learn for digits).
Your own data or model: see "Your own data and model" in docs/train_ddp.md.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import gc
import hashlib
import json
import math
import os
import random
import shutil
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
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
    a("--tf32", default="auto", choices=["auto", "off"], help="auto: TF32 for fp32 on GPUs from Ampere on")
    a("--max-skipped-steps", type=int, default=3, metavar="K",
      help="stop with an error after K optimizer steps in a row skipped for a non-finite loss or gradient")
    a("--clip-grad-norm", type=float, default=None, metavar="X",
      help="clip the global gradient norm to X, once per optimizer step (default: measure, never clip)")
    a("--grad-compression", default="none", choices=["none", "fp16", "bf16"])
    a("--bucket-cap-mb", type=float, default=None,
      help="DDP gradient bucket size in MiB (default: DDP's own, 25 with a small first bucket)")
    a("--compile", action="store_true", help="compile the model (its forward, in place), then wrap it in DDP")
    a("--ckpt-dir", default=None)
    a("--save-every", type=int, default=100, help="steps between checkpoints")
    a("--resume", default="auto", help="auto (D/last.pt or D/last.dcp if it exists) | PATH | none")
    a("--ckpt-format", default="pt", choices=["pt", "dcp"], help="pt: one file that rank 0 writes; dcp: "
      "a folder every rank writes its part of (torch.distributed.checkpoint; shared storage)")
    a("--crash-at-step", type=int, default=None, help="teaching: die after this step, 1st attempt")
    a("--metrics-out", default=None, help="JSON lines file (appended, rank 0)")
    a("--log-every", type=int, default=50, help="steps between train records (each is a sync point)")
    a("--num-workers", type=int, default=0)
    a("--device", default="auto", choices=["auto", "cpu", "cuda"])
    a("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    a("--timeout", type=float, default=300.0, help="seconds for init and each collective")
    a("--profile-steps", default=None, type=step_range, metavar="A:B",
      help="torch.profiler trace of optimizer steps A to B, one Chrome trace per rank")
    a("--profile-dir", default="profile", help="where --profile-steps writes rank{R}.json")
    a("--progress", default="auto", choices=["auto", "on", "off"], help="tqdm bar on rank 0")
    return p.parse_args(argv)


def step_range(text: str) -> tuple[int, int]:
    """--profile-steps "A:B" -> (A, B), 1 <= A <= B: the optimizer steps to trace (counted from 1)."""
    try:
        first, last = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B (two step numbers, e.g. 10:12)") from None
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= A <= B (steps count from 1)")
    return first, last


class UsageError(Exception):
    """Bad input: rank 0 prints one message, every rank exits with code 2, no traceback."""


TORCH_FLOOR = (2, 4)  # tried: every flag ran on torch 2.4.1; 2.3 fails in DDP's constructor (bucket_cap_mb=None)


def validate(args) -> None:
    """Checks that need nothing but the arguments: every rank reaches the same verdict."""
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if have < TORCH_FLOOR:
        raise UsageError(f"torch {torch.__version__} is older than this script needs: pip install 'torch>=2.4'")
    for name in ("batch_size", "epochs", "accum_steps", "save_every", "log_every", "max_skipped_steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    for name in ("max_steps", "crash_at_step"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
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
    """What the model learns and how a batch reaches it, in one place: adapting the script to another
    task or another shape of data is changing this class (or a subclass of it), never the loops.

    A sample is (input, target), or a dict whose "labels" entry is the target and whose other entries
    are the model's keyword arguments. classification: class indices, torch.long, one per sample (N,)
    or one per position (N, T) against outputs (B, T, classes); -100 marks a position that counts
    nowhere (padding); cross-entropy; loss and accuracy. regression: torch.float32 shaped as the
    model's output, (N, outputs) or (N, T, outputs); mean squared error; loss (MSE) and RMSE."""

    collate_fn = None  # how samples become a batch, in both loaders; None: torch's default_collate
    labels = "labels"  # a dict sample's target
    probe_samples = 64  # samples read to check a Dataset that is not a TensorDataset

    def __init__(self, kind: str, outputs: int):
        self.kind, self.outputs, self.shape, self.example = kind, outputs, None, None

    def __str__(self):  # the start line's words for the model's output
        return f"{self.outputs} classes" if self.kind == "classification" else f"regression, {self.outputs} output(s)"

    # ------------------------------------------------ how a batch reaches the device and the model
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

    # ------------------------------------------------ loss and metrics
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

    # ------------------------------------------------ the data, checked before its first use
    def check_data(self, splits: dict, world_size: int) -> str | None:
        """The one-line fix when a split cannot train or be evaluated, else None (and self.shape is one
        input sample's shape, self.example the first training samples, batched)."""
        for name, data in splits.items():
            if len(data) < (1 if name == "training" else world_size):  # every rank evaluates at least one
                return (f"the {name} set has {len(data)} sample(s){f' for {world_size} ranks' * bool(len(data))}: "
                        f"build_data must return at least {1 if name == 'training' else world_size}; check its "
                        "path and split, or hold out more samples")
            if problem := self.check_split(name, data):
                return problem
        return None

    def check_split(self, name, data) -> str | None:
        try:  # the first samples, batched as the loaders will batch them
            batch = self.batch(data, self.probe_samples)
        except (RuntimeError, TypeError) as e:
            return (f"the {name} samples cannot be batched ({str(e).splitlines()[0][:120]}): give them one shape, "
                    "or set Task.collate_fn to a function that pads them (docs/train_ddp.md)")
        x, y = self.inputs(batch), self.target(batch)
        if name == "training":
            first = self.inputs(self.batch(data, 1))
            self.shape = (tuple((k, *v.shape[1:]) for k, v in first.items()) if isinstance(first, dict)
                          else tuple(first.shape[1:]))  # one sample's shape, read from the data itself
            self.example = self.batch(data, 2)
        tensors = list(x.values()) if isinstance(x, dict) else [x]
        if isinstance(data, TensorDataset):  # all of it, cheaply
            tensors, y = list(data.tensors[:-1]), data.tensors[-1]
        elif hasattr(data, "targets"):  # torchvision's data sets keep their labels in a list
            y = data.targets
        for t in tensors:
            if torch.is_tensor(t) and t.is_floating_point() and t.dtype != torch.float32:  # numpy's float64
                return (f"the inputs are {t.dtype}, the model float32: build the dataset from "
                        "torch.tensor(X, dtype=torch.float32)")
            if torch.is_tensor(t) and t.is_floating_point() and not t.isfinite().all():
                return (f"the {name} inputs hold NaN or infinite values: drop or fill those samples in build_data "
                        "(a constant feature divided by its standard deviation, 0, gives NaN: drop that feature, "
                        "or divide by std.clamp_min(1e-6))")
        return self.check_target(name, y)

    def check_target(self, name, y) -> str | None:
        """A wrong shape trains without an error: (N,) targets against (B, 1) outputs broadcast to a (B, B) loss."""
        try:
            y = torch.as_tensor(y)
        except (TypeError, ValueError, RuntimeError):
            y = None
        if y is None or not (y.is_floating_point() or y.dtype in (torch.long, torch.int32, torch.int16, torch.uint8)):
            return (f"the {name} targets are not numbers: map each label to its class index, e.g. torch.tensor("
                    "[names.index(s) for s in labels], dtype=torch.long), and return len(names) from build_data")
        if self.kind == "classification":
            if y.dtype != torch.long:
                return (f"classification targets are class indices, torch.long; these are {y.dtype}: build them "
                        "with torch.tensor(labels, dtype=torch.long), or use --task regression")
            y = y[y != -100]
            if len(y) and not 0 <= y.min() <= y.max() < self.outputs:
                return (f"class labels must be in [0, {self.outputs}) for {self.outputs} classes, these span "
                        f"{y.min().item()} to {y.max().item()}: number the classes from 0, or return their number from build_data")
            return None
        if y.dtype != torch.float32:
            return (f"regression targets are {y.dtype}, the model's output torch.float32: build them with "
                    "torch.tensor(y, dtype=torch.float32)")
        if y.dim() < 2 and self.outputs == 1:
            return (f"regression targets shaped {tuple(y.shape)} would broadcast against outputs shaped "
                    f"(batch, 1): want torch.float32 shaped (N, 1), e.g. y.reshape(-1, 1)")
        if y.dim() < 2 or y.shape[-1] != self.outputs:
            values = 1 if y.dim() < 2 else y.shape[-1]
            return (f"regression targets shaped {tuple(y.shape)} hold {values} value(s) per sample, the model has "
                    f"{self.outputs} output(s): return {values} from build_data (its third value)"
                    + (", with y.reshape(-1, 1)" if y.dim() < 2 else ""))
        return None

    def check_output(self, model, device) -> str | None:
        """The model's output on the first two training samples (no gradients, eval mode: nothing
        changes) against their targets: a shape that cannot match, named before the first step."""
        batch = self.to_device(self.example, device)
        with torch.no_grad():
            model.eval()
            out, y = self.forward(model, batch), self.target(batch)
        model.train()
        want = (*y.shape, self.outputs) if self.kind == "classification" else tuple(y.shape)
        if tuple(out.shape) == want:
            return None
        if out.shape[-1] != want[-1]:
            return (f"the model gives {out.shape[-1]} values per prediction, the task wants {want[-1]}: "
                    f"build the model's last layer with the outputs build_data returns ({self.outputs})")
        return (f"the model's output is shaped {tuple(out.shape)} for targets shaped {tuple(y.shape)}, want "
                f"{want}: one target per prediction (per sample, or per position of a sequence)")


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


def params_sha256(model: nn.Module) -> str:
    """sha256 over every state_dict tensor's bytes, in state_dict order: bitwise equality, cheaply."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
              "dataset": "--dataset", "train_samples": "training samples", "classes": "model outputs",
              "input_shape": "input shape", "task": "--task"}


def run_spec(args, train_set, classes, shape) -> dict:
    width = mlp_width(args) if args.model in ("mlp", "wide_mlp") else None
    return {"model": args.model, "width": width, "batch_norm": args.batch_norm, "dropout": args.dropout,
            "dataset": args.dataset, "train_samples": len(train_set), "classes": classes,
            "input_shape": list(shape), "task": args.task}


def read_checkpoint(path: str, spec: dict):
    """(checkpoint, None) or (None, the one-line reason it cannot be resumed)."""
    sharded = os.path.isdir(path)  # --ckpt-format dcp: the small state is in meta.pt, the tensors beside it
    try:  # weights_only: a checkpoint is data, never code to run
        ckpt = torch.load(os.path.join(path, "meta.pt") if sharded else path, map_location="cpu", weights_only=True)
    except Exception as e:
        return None, f"cannot read checkpoint {path!r} ({type(e).__name__}): delete it or pass --resume none"
    if not isinstance(ckpt, dict) or not ({"step"} if sharded else {"model", "optimizer", "step"}) <= ckpt.keys():
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
    path = os.path.join(path, "meta.pt") if os.path.isdir(path) else path  # a dcp folder: its meta.pt, written last
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
    box = [None, None, None]  # path, its fingerprint on rank 0, why it cannot be resumed
    if rank == 0:
        path = args.resume if args.resume not in ("auto", "none") else None
        if args.resume == "auto" and args.ckpt_dir:
            path = latest_checkpoint(args.ckpt_dir, args.ckpt_format)
        box = [path, file_fingerprint(path) if path else None, path and format_error(path, args.ckpt_format)]
    dist.broadcast_object_list(box, src=0)
    path, mark, err = box
    if err or (path and mark is None):
        raise UsageError(err or f"--resume {path!r}: no such file (use auto, none or a checkpoint path)")
    if path is None:
        return None, None, None
    seen = torch.tensor([int(file_fingerprint(path) == mark)], device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)  # 1: every rank sees rank 0's file
    if not seen.item() and args.ckpt_format == "dcp":  # each rank reads its own part of the folder
        raise UsageError(f"--ckpt-format dcp needs every rank to see {path!r} (shared storage): put "
                         "--ckpt-dir on a filesystem every node mounts, or use --ckpt-format pt")
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


def latest_checkpoint(folder: str, fmt: str) -> str | None:
    """--resume auto: last.pt, or the folder last.dcp (last.dcp.old when a save died between its two
    renames). The other format's checkpoint is returned too, so that resuming refuses it by name."""
    names = ["last.dcp", "last.dcp.old", "last.pt"] if fmt == "dcp" else ["last.pt", "last.dcp", "last.dcp.old"]
    found = [p for p in (os.path.join(folder, n) for n in names) if os.path.exists(p)]
    return found[0] if found else None


def format_error(path: str, fmt: str) -> str | None:
    """The one-line fix when `path` holds the other --ckpt-format's checkpoint, or is a folder that
    no complete dcp save left (no meta.pt), else None."""
    other = "dcp" if os.path.isdir(path) else "pt"
    if os.path.exists(path) and other != fmt:
        return (f"{path!r} is a --ckpt-format {other} checkpoint ({'a folder' if other == 'dcp' else 'a file'}), "
                f"this run has --ckpt-format {fmt}: add --ckpt-format {other} to resume it, or pass --resume none")
    if other == "dcp" and not os.path.isfile(os.path.join(path, "meta.pt")):
        return (f"{path!r} has no meta.pt, so no save completed it: pass a checkpoint folder "
                "(DIR/last.dcp), --resume auto or --resume none")
    return None


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


def progress_bar(mode, total, initial, is_main):
    """A tqdm bar on rank 0 with --progress on, or auto and a terminal attached; else None."""
    if not is_main or mode == "off" or (mode == "auto" and not sys.stderr.isatty()):
        return None
    try:
        from tqdm import tqdm  # optional: a bar when a terminal is attached, plain lines otherwise
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


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


def set_tf32(args, device) -> str:
    """TF32 for --precision fp32 from compute capability 8.0 (Ampere): 10 mantissa bits in, fp32 sums."""
    on = (args.tf32 == "auto" and args.precision == "fp32" and device.type == "cuda"
          and torch.cuda.get_device_capability(device) >= (8, 0))  # bf16/fp16: autocast's matmuls are 16-bit
    # One API, the one every torch since 1.12 has and every getter survives: torch 2.9's fp32_precision
    # setters would leave torch.get_float32_matmul_precision() raising (mixed legacy and new API)
    torch.set_float32_matmul_precision("high" if on else "highest")
    torch.backends.cudnn.allow_tf32 = on
    return " (TF32)" if on else ""


def wrap_model(args, model, device):
    """The DDP model: compiled first if asked, DDP's buckets holding the gradients, an optional compression hook."""
    if args.compile:  # forward, in place, before DDP: names keep no "_orig_mod." prefix, and a bare nn.Sequential
        model.forward = torch.compile(model.forward)  # compiles on torch < 2.14 too (model.compile() skipped it)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True)  # .grad = a view: no copy back
    if args.grad_compression != "none":  # gradients cast to 16 bits for the all-reduce only
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hooks
        ddp_model.register_comm_hook(None, getattr(hooks, f"{args.grad_compression}_compress_hook"))
    return ddp_model


def resume(args, rank, world_size, spec, stateful, device, steps_per_epoch):
    """Load the checkpoint --resume names (if any) into `stateful` (model, optimizer, scheduler,
    scaler); returns (epoch, samples_in_epoch, step) to continue from, the checkpoint's path, and
    who read it ("every rank" or "rank 0")."""
    ckpt, path, reader = resume_state(args, rank, spec, device)
    if ckpt is None:
        return (0, 0, 0), None, None
    scheduler = stateful["scheduler"]
    base_lrs = list(scheduler.base_lrs)  # this layout's, before the checkpoint's replace them
    sharded = args.ckpt_format == "dcp"  # the model and optimizer are in the folder's parts, not in ckpt
    for name, obj in stateful.items():
        try:
            if sharded and name == "model":
                load_sharded(path, obj, stateful["optimizer"])
            elif not (sharded and name == "optimizer"):
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
    err, sharded = None, config["ckpt_format"] == "dcp"  # dcp: every rank writes its part of the folder `path`
    if dist.get_rank() == 0 or sharded:
        try:
            state = {**{name: obj.state_dict() for name, obj in stateful.items()},
                     "epoch": epoch, "samples_in_epoch": samples_in_epoch, "step": step,
                     "rng": rngs, "spec": spec, "config": config}
            save_sharded(path, stateful, state) if sharded else atomic_save(path, state)
        except (OSError, RuntimeError) as e:  # torch.save wraps a failed write in a RuntimeError
            if os_error_in(e) is None:
                raise
            name = os.path.basename(path)  # last.pt, or the folder last.dcp
            kept = (f"{name} is still the step-{saved_step} checkpoint" if saved_step is not None
                    else f"{name} was left as it was" if os.path.exists(path) else "nothing was written")
            err = (f"{describe_write_error(e)} while saving {path} at step {step}; the temporary "
                   f"{'folder' if sharded else 'file'} was removed and {kept}: free space or choose "
                   "another --ckpt-dir, then run again")
    agree(err)  # nobody runs ahead (or exits) before the checkpoint is complete, or all stop


def save_sharded(path, stateful, state):
    """--ckpt-format dcp: every rank writes its part of the model and optimizer into PATH.tmp/
    (torch.distributed.checkpoint: no rank gathers them whole), rank 0 adds meta.pt (the rest of
    `state`) and renames the complete folder to PATH. A crash between its two renames leaves the
    previous checkpoint as PATH.old, which --resume auto takes."""
    import torch.distributed.checkpoint as dcp  # lazy: importing it costs about 2 s
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp, old, rank = path + ".tmp", path + ".old", dist.get_rank()
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # what a save killed midway left
        dist.barrier()
        parts = dict(zip(("model", "optimizer"), get_state_dict(stateful["model"], stateful["optimizer"])))
        try:  # returns on every rank once every rank's part is written
            dcp.save(parts, checkpoint_id=tmp)
        except dcp.CheckpointException as e:  # a BaseException, raised on every rank: the first failure
            raise RuntimeError("dcp.save failed") from next(iter(e.failures.values()))[0]
        if rank == 0:  # meta.pt is written last: a folder without it is incomplete
            atomic_save(os.path.join(tmp, "meta.pt"), {k: v for k, v in state.items() if k not in parts})
            if os.path.isdir(path):
                shutil.rmtree(old, ignore_errors=True)  # PATH is complete, so an older PATH.old is stale
                os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
            if hasattr(os, "O_DIRECTORY"):  # and the renames survive a power cut (POSIX)
                fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_DIRECTORY)
                os.fsync(fd)
                os.close(fd)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written folder behind
        raise


def load_sharded(path, model, optimizer):
    """--ckpt-format dcp: each rank fills its own model and optimizer state from the folder's parts."""
    import torch.distributed.checkpoint as dcp  # lazy: importing it costs about 2 s
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))  # dcp.load fills these in place
    damaged = f"checkpoint {path!r} is damaged: "
    try:
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata  # each tensor's name and size
    except Exception as e:  # noqa: BLE001 - cut short or overwritten
        raise UsageError(f"{damaged}its .metadata cannot be read ({type(e).__name__}): use another --ckpt-dir "
                         "or --resume none") from None
    ours = {**{f"model.{k}": v for k, v in state["model"].items()}, **{f"optimizer.state.{p}.{k}": v
            for p, s in state["optimizer"]["state"].items() for k, v in s.items() if torch.is_tensor(v)}}
    differ = [k for k, v in ours.items() if list(getattr(saved.get(k), "size", [-1])) != list(v.shape)]
    if differ or any(k.startswith("model.") and k not in ours for k in saved):
        raise UsageError(f"checkpoint {path!r} does not fit this run's model and optimizer (first: "
                         f"{(differ or ['an extra tensor'])[0]}): use the same settings, another --ckpt-dir "
                         "or --resume none")
    try:
        dcp.load(state, checkpoint_id=path)
    except dcp.CheckpointException as e:  # a BaseException, raised on every rank
        cause = "".join(c for c in str(e).strip().splitlines()[-1] if c.isprintable())[:200]
        raise UsageError(f"{damaged}its tensors fit this run but a part of the folder cannot be read ({cause}): "
                         "use another --ckpt-dir or --resume none") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def workers_start(device, num_workers: int) -> str | None:
    """How DataLoader workers start: on a GPU, from a fork server, never forked from this process
    once it holds a CUDA context and an NCCL communicator (DDP's docstring warns that forking then
    is unsafe); on the CPU, a plain fork (faster to start)."""
    return "forkserver" if num_workers > 0 and device.type == "cuda" else None


def evaluation_loader(val_set, rank, world_size, num_workers, device, collate_fn=None):
    """Every validation sample on exactly one rank (rank, rank + world_size, ...): no padding
    copies, which DistributedSampler adds to even out shards and which would count twice."""
    return DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=256,
                      num_workers=num_workers, persistent_workers=num_workers > 0,
                      multiprocessing_context=workers_start(device, num_workers), collate_fn=collate_fn)


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


class StepProfiler:
    """--profile-steps A:B: torch.profiler over optimizer steps A..B, one Chrome trace per rank
    (PROFILE_DIR/rank{R}.json; open it in ui.perfetto.dev or chrome://tracing)."""

    def __init__(self, steps, folder, rank, device):
        self.first, self.last = steps or (0, -1)
        self.path = os.path.join(folder, f"rank{rank}.json")
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        if device.type == "cpu":  # kineto's "gpuGetDeviceCount failed" on a CPU-only machine is noise
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        self.prof = None

    def update(self, step):
        """Call before the first step and after every step, with the number of steps done."""
        if self.prof is None and step + 1 == self.first:
            self.prof = torch.profiler.profile(activities=self.activities)
            self.prof.start()
        elif self.prof is not None and step >= self.last:
            self.finish()

    def finish(self):
        if self.prof is not None:
            self.prof.stop()
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self.prof.export_chrome_trace(self.path)
            self.prof = None


class StepLog:
    """After every optimizer step: the train record and rank 0's line (every --log-every steps, at the
    last and at every skipped step), the progress bar, and the non-finite guard, which stops a run after
    --max-skipped-steps skipped steps in a row, or at its end if it skipped every step it took."""

    def __init__(self, args, window, metrics, bar, is_main, step, resumed, max_steps, end):
        self.args, self.window, self.metrics, self.bar, self.is_main = args, window, metrics, bar, is_main
        self.max_steps, self.last = max_steps, min(max_steps, end)  # where --max-steps, or the data, ends the run
        self.partial = step if resumed and step % args.log_every else None  # the first record then averages fewer steps
        self.in_a_row, self.first_step = 0, step  # optimizer steps skipped in a row (non-finite); where this run began

    def step(self, step, epoch, lr_used, grad_norm, skipped, scaler):
        # fp16: GradScaler skips steps while it lowers its scale from 65536 to one that fits; a skip at a
        # scale of 1 or less (or with no scaler) means the loss or the gradients themselves are not finite
        self.in_a_row = self.in_a_row + 1 if skipped and scaler.get_scale() <= 1 else 0
        if self.bar:
            self.bar.update(1)
        if step % self.args.log_every == 0 or step == self.max_steps or skipped:  # a skip is always recorded
            n = self.window.steps  # the steps this record averages
            rec = self.window.record(step=step, epoch=epoch, lr=lr_used, grad_norm=grad_norm.item(),
                                     skipped=skipped, steps=n)
            self.metrics.write("train", **rec)
            since = (f" (loss of the {n} step{'s' * (n != 1)} since the resume at step {self.partial}; an "
                     f"uninterrupted run's record averages {self.args.log_every})") if self.partial is not None else ""
            say(self.bar, self.is_main, f"step {step} epoch {epoch} loss {rec['loss']:.4f} lr {lr_used:.4g} "
                f"{rec['samples_per_s']:.0f} samples/s" + (" (skipped: non-finite gradients)" if skipped else "")
                + since)
            self.partial = None
        # the same count on every rank (the gradients were all-reduced); never exit 0 having trained nothing
        stuck = self.in_a_row == step - self.first_step and step >= self.last  # every step of this run skipped
        if self.in_a_row >= self.args.max_skipped_steps or stuck:
            raise UsageError(f"{self.in_a_row} optimizer step(s) in a row skipped, up to step {step}: the loss or the "
                             "gradients are not finite. Lower --lr, standardise the inputs and regression targets "
                             "(docs/train_ddp.md), or clip with --clip-grad-norm; --max-skipped-steps K allows more")


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


def say(bar, is_main, text):
    """Rank 0 prints (above the progress bar, if there is one)."""
    if bar:
        bar.write(text)
    elif is_main:
        print(text, flush=True)


def crash(rank, step, attempt):
    """--crash-at-step: SIGKILL, not an exception: nothing in Python runs (no finally, no flush), as
    when the OOM killer or a lost node takes the job. Every rank dies after the same step, so none
    is left blocked in a collective with a dead peer; torchrun then restarts all of them."""
    print(f"crash-at-step {step}: killing rank {rank} (attempt {attempt})", flush=True)
    os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))


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
    agree(task.check_output(raw_model, device))  # its output against the targets, before the first step
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
                        multiprocessing_context=workers_start(device, args.num_workers), collate_fn=task.collate_fn)
    val_loader = evaluation_loader(val_set, rank, world_size, args.num_workers, device, task.collate_fn)
    batches_per_epoch = math.ceil(sampler.num_samples / args.batch_size)
    steps_per_epoch = math.ceil(batches_per_epoch / args.accum_steps)
    optimizer, scheduler = build_optimizer(args, raw_model, world_size, steps_per_epoch)
    # fp16 needs loss scaling (its small range underflows gradients); bf16 has fp32's range.
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    stateful = {"model": raw_model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    # Resume before DDP wraps the model: DDP broadcasts rank 0's weights at construction.
    (epoch, position, step), resumed, reader = resume(args, rank, world_size, spec, stateful, device, steps_per_epoch)
    model = wrap_model(args, raw_model, device)
    tf32 = set_tf32(args, device)

    metrics = Metrics(args.metrics_out, is_main, attempt)
    run_config = {**vars(args), "world_size": world_size}  # what checkpoints record of this run
    effective_batch = args.batch_size * world_size * args.accum_steps
    lr, total_steps = optimizer.param_groups[0]["initial_lr"], args.epochs * steps_per_epoch
    say(None, is_main, f"world_size={world_size} backend={backend} device={device}{tf32} model={args.model} "
        f"dataset={args.dataset} ({len(train_set)} train, {len(val_set)} val, {task}) "
        f"effective batch={args.batch_size} x {world_size} ranks x {args.accum_steps} accum "
        f"= {effective_batch}, lr={lr:g}, {steps_per_epoch} steps/epoch")
    metrics.write("config", **{**run_config, "backend": backend, "device": str(device)},
                  effective_batch=effective_batch, lr_effective=lr, steps_per_epoch=steps_per_epoch,
                  total_steps=total_steps)
    if resumed:
        metrics.write("resume", step=step, epoch=epoch, path=resumed, read_by=reader)
        say(None, is_main, f"resumed from {resumed} at step {step} (epoch {epoch}, sample {position})")

    last_pt = os.path.join(args.ckpt_dir, f"last.{args.ckpt_format}") if args.ckpt_dir else None  # or last.dcp/
    saved_step = step if resumed and resumed == last_pt else None  # the step last.pt holds
    end = step + steps_left(len(train_set), epoch, position, args, world_size)  # where the data ends
    max_steps = args.max_steps or end
    bar = progress_bar(args.progress, min(max_steps, end), step, is_main)
    per_batch = args.batch_size * world_size  # samples all ranks use per batch
    window = Window(device)
    log = StepLog(args, window, metrics, bar, is_main, step, resumed, max_steps, end)
    loader_rng.manual_seed(rank_seed(args.seed, rank) + epoch)  # workers' seeds, once: the workers persist
    profiler = StepProfiler(args.profile_steps, args.profile_dir, rank, device)
    profiler.update(step)
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
            profiler.update(step)
            log.step(step, epoch, lr_used, grad_norm, skipped, scaler)  # a record, a line; a diverged run stopped
            if last_pt and step % args.save_every == 0:
                save_checkpoint(last_pt, stateful, (epoch, position + i * per_batch, step), spec, run_config, device, saved_step)
                saved_step = step
                metrics.write("ckpt", step=step, path=last_pt)
            if args.crash_at_step == step and attempt == 0:
                crash(rank, step, attempt)
            if step >= max_steps:
                break
        with window.paused():  # after every epoch, and where --max-steps stopped mid-epoch
            sync_buffers(raw_model)  # every rank evaluates the same model
            scores = evaluate(raw_model, val_loader, device, amp_dtype, task)
        metrics.write("eval", epoch=epoch, step=step, **scores)
        say(bar, is_main, f"eval epoch {epoch} step {step}: {task.describe(scores)}")
        epoch, position = (epoch + 1, 0) if i >= batches else (epoch, position + i * per_batch)
    profiler.finish()
    if bar:
        bar.close()
    if last_pt and saved_step != step:
        save_checkpoint(last_pt, stateful, (epoch, position, step), spec, run_config, device, saved_step)
        metrics.write("ckpt", step=step, path=last_pt)
    digest = params_sha256(raw_model)
    metrics.write("final", step=step, params_sha256=digest)
    dist.barrier()  # every rank is done with every collective before the group is torn down
    say(None, is_main, f"done: step {step}, params sha256 {digest[:16]}...")


@record  # under torchrun, a rank's traceback lands in torchrun's failure summary (not "error_file: <N/A>")
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
