"""Notebook 11: what changes when the same DDP program runs on GPUs, measured where a CPU can.

    from ddp_lab.lessons import gpus
    gpus.matmul_errors(512)            # fp32, TF32 (emulated: inputs rounded to 10 mantissa bits), bf16
    gpus.bf16_in_hardware((7, 0))      # False: a V100 only emulates bf16
    gpus.worker_pids(persistent=True)  # the DataLoader worker of every epoch: the same process

TF32 is a Tensor Core input format: fp32's 8 exponent bits, 10 of its 23 mantissa bits. A GPU
rounds the inputs of an fp32 matmul or convolution to it and accumulates in fp32, so its error
is the inputs' rounding; rounding the inputs here and multiplying in fp64 reproduces that.
"""
from __future__ import annotations

import os

import torch

FP32_MANTISSA_BITS = 23
TF32_MANTISSA_BITS = 10
BF16_MANTISSA_BITS = 7
BF16_FROM = (8, 0)   # compute capability of the first GPUs with bf16 Tensor Cores (A100, Ampere)

# Compute capabilities of common data-centre and desktop GPUs (NVIDIA's CUDA GPU list).
GPUS = {"V100": (7, 0), "T4": (7, 5), "A100": (8, 0), "A10 / RTX 3090": (8, 6), "L4 / RTX 4090": (8, 9),
        "H100 / H200": (9, 0), "B200": (10, 0), "RTX 5090": (12, 0)}


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 values rounded to `bits` mantissa bits, to nearest, ties to even (finite values)."""
    drop = FP32_MANTISSA_BITS - bits
    raw = x.float().contiguous().view(torch.int32)
    half = (1 << (drop - 1)) - 1
    raw = raw + half + ((raw >> drop) & 1)
    return (raw & ~((1 << drop) - 1)).view(torch.float32)


def matmul_errors(n: int = 512, seed: int = 0) -> dict:
    """Relative error (Frobenius) of an n x n matmul against fp64, for each input format."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    b = torch.randn(n, n, generator=g, dtype=torch.float64)
    exact = a @ b

    def err(c):
        return float((c.double() - exact).norm() / exact.norm())
    return {"fp32": err(a.float() @ b.float()),
            "tf32": err(round_mantissa(a.float(), TF32_MANTISSA_BITS).double()
                        @ round_mantissa(b.float(), TF32_MANTISSA_BITS).double()),
            "bf16": err(a.to(torch.bfloat16).double() @ b.to(torch.bfloat16).double())}


def bf16_in_hardware(capability) -> bool:
    """bf16 Tensor Cores, not emulation: torch.cuda.is_bf16_supported() says True on a V100 or T4
    too (including_emulation=True by default); the capability says what the silicon does."""
    return tuple(capability) >= BF16_FROM


def precision_settings() -> dict:
    """What fp32 matmuls and convolutions may use on a GPU, as this torch is set now. A getter that
    raises is shown as such: after torch.backends.cuda.matmul.fp32_precision = "tf32" (torch 2.9+),
    get_float32_matmul_precision() and allow_tf32 raise ("mix of the legacy and new APIs")."""
    def read(get):
        try:
            return get()
        except (RuntimeError, AttributeError) as e:
            return f"raises {type(e).__name__}"
    return {"torch.get_float32_matmul_precision()": read(torch.get_float32_matmul_precision),
            "torch.backends.cuda.matmul.fp32_precision": read(lambda: torch.backends.cuda.matmul.fp32_precision),
            "torch.backends.cudnn.allow_tf32": read(lambda: torch.backends.cudnn.allow_tf32)}


class _Pids(torch.utils.data.Dataset):
    """Eight items, each the id of the process that loaded it."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return os.getpid()


def worker_pids(persistent: bool, epochs: int = 3) -> list:
    """The worker processes that loaded each epoch, with one DataLoader worker."""
    loader = torch.utils.data.DataLoader(_Pids(), batch_size=4, num_workers=1,
                                         persistent_workers=persistent)
    return [sorted({int(p) for batch in loader for p in batch}) for _ in range(epochs)]
