"""The survey article's DataLoader knobs, measured on a loader with a deliberately slow transform.

    from ddp_lab.lessons import loading
    results = loading.measure_all()          # one dict per configuration in CONFIGS
    loading.serial_estimate_s()              # loading then stepping, one after the other

Each sample's transform sleeps SLOW_S (3x that in every 4th batch), standing in for reading and
decoding a file; each training step sleeps STEP_S, standing in for a GPU that computes while the
CPU loads. num_workers > 0 loads in parallel worker processes that work ahead of the step
(prefetch_factor batches each); persistent_workers keeps them between epochs instead of starting
new ones; pin_memory matters only with CUDA (page-locked host memory that the GPU can copy from
asynchronously). `python -m ddp_lab.experiments.nb02_loader` prints the same table.
"""
from __future__ import annotations

import os
import time

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

SLOW_S = 0.002     # per sample
STEP_S = 0.015     # per batch
SAMPLES, BATCH, EPOCHS = 128, 16, 2

CONFIGS = {
    "num_workers=0": dict(num_workers=0),
    "num_workers=2": dict(num_workers=2),
    "+ persistent_workers": dict(num_workers=2, persistent_workers=True),
    "+ prefetch_factor=4": dict(num_workers=2, persistent_workers=True, prefetch_factor=4),
}


class SlowDigits(Dataset):
    """Digits-shaped samples whose transform takes SLOW_S; reports the loading process."""

    def __init__(self, n: int = SAMPLES):
        g = torch.Generator().manual_seed(0)
        self.X = torch.rand(n, 1, 8, 8, generator=g)

    def __len__(self) -> int:
        return len(self.X)

    def __getitem__(self, i):
        # the slow part (I/O, decoding); every 4th batch is 3x slower, as real files vary
        time.sleep(SLOW_S * (3 if (i // BATCH) % 4 == 0 else 1))
        info = get_worker_info()
        return self.X[i] * 2 - 1, i, os.getpid(), -1 if info is None else info.id


def measure(name: str, knobs: dict) -> dict:
    loader = DataLoader(SlowDigits(), batch_size=BATCH, **knobs)
    t0 = time.perf_counter()
    first_batch_s, seen, pids = [], [], set()
    for _ in range(EPOCHS):
        e0 = time.perf_counter()
        for b, (x, idx, pid, wid) in enumerate(loader):
            if b == 0:
                first_batch_s.append(time.perf_counter() - e0)
            seen += idx.tolist()
            pids |= set(pid.tolist())
            time.sleep(STEP_S)  # the training step
    total = time.perf_counter() - t0
    del loader  # stop persistent workers now, not at garbage collection
    return {"config": name, "total_s": total, "first_batch_s": first_batch_s,
            "indices": seen, "loader_pids": sorted(pids)}


def serial_estimate_s() -> float:
    """Loading and stepping one after the other, with no overhead at all."""
    load = sum(SLOW_S * (3 if (i // BATCH) % 4 == 0 else 1) for i in range(SAMPLES))
    return EPOCHS * (load + SAMPLES // BATCH * STEP_S)


def measure_all() -> list[dict]:
    return [measure(name, knobs) for name, knobs in CONFIGS.items()]


def pinned_copy_gbps(mb: int = 64) -> dict | None:
    """Host-to-GPU copy speed from pageable vs pinned memory; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    out = {}
    for pinned in (False, True):
        x = torch.empty(mb * 2**20, dtype=torch.uint8, pin_memory=pinned)
        x.to("cuda"); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            x.to("cuda", non_blocking=pinned)
        torch.cuda.synchronize()
        out["pinned" if pinned else "pageable"] = 5 * x.nbytes / (time.perf_counter() - t0) / 1e9
    return out
