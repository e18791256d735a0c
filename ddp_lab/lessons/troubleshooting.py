"""Two checks to paste into a DDP training loop (notebook 07), and the NaN guard they pair with.

    from ddp_lab.lessons.troubleshooting import replica_check, finite_everywhere

    report = replica_check(model)            # every rank calls it; collective
    if not report.ok:
        print(report)                        # which ranks differ from rank 0, and in which tensors

    loss.backward()                          # DDP all-reduces: every rank now holds the same gradients
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if torch.isfinite(norm):                 # the same norm on every rank, so the same decision:
        optimizer.step()                     # a NaN anywhere skips the step everywhere, no collective

    ok, bad = finite_everywhere(loss)        # diagnosis: which ranks have a NaN/inf loss (collective)

replica_check hashes the exact bytes of every parameter (a difference in the last bit counts)
and of every buffer DDP will not overwrite, all-gathers one 63-bit hash per tensor and compares
each rank with rank 0, the rank DDP broadcasts from. Under DDP's default broadcast_buffers=True
the buffers are skipped: the next forward re-sends rank 0's, and BatchNorm's running statistics
differ between ranks after every step of a healthy model. The cost is not the all-gather but the
hashing: every tensor is copied to the CPU and hashed byte by byte (notebook 07 times it). It is
a diagnostic for every few hundred steps or before saving, not for the hot loop.

finite_everywhere costs a host sync and an all_gather: use it to name the bad rank, not every step.

Also here, for notebook 07 and its probes (ddp_lab/experiments/nb07_*.py): TwoHeads and Twice,
the models whose unused or twice-used parameters break DDP, and LATE_RANK, the rank that never
reaches the monitored barrier.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from ddp_lab.lessons import plural


@dataclass
class ReplicaReport:
    ok: bool
    differing_ranks: list = field(default_factory=list)    # ranks whose tensors differ from rank 0's
    differing_tensors: list = field(default_factory=list)  # names, as in model.state_dict()
    world_size: int = 1
    unchecked: list = field(default_factory=list)          # buffers left out (DDP overwrites them)

    def __str__(self) -> str:
        if self.ok:
            left = (f" ({plural(len(self.unchecked), 'buffer')} not compared: DDP re-sends rank 0's)"
                    if self.unchecked else "")
            return f"all {self.world_size} replicas are identical{left}"
        names = ", ".join(self.differing_tensors[:6]) + (" ..." if len(self.differing_tensors) > 6 else "")
        tensors = plural(len(self.differing_tensors), "tensor")
        return f"ranks {self.differing_ranks} differ from rank 0 in {tensors}: {names}"


def tensor_hash(t: torch.Tensor) -> int:
    """A 63-bit hash of a tensor's dtype, shape and exact bytes."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    t = t.detach().to("cpu").contiguous().reshape(-1)   # 1-d: a 0-d tensor cannot be viewed as bytes
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


def replica_check(model: torch.nn.Module, group=None, buffers: bool | None = None) -> ReplicaReport:
    """Compare parameters, and buffers DDP will not overwrite, across ranks. Collective.

    buffers=None (the default) compares buffers unless `model` is a DDP that syncs them
    (broadcast_buffers=True, called forward_sync_buffers since torch 2.13; both default to True):
    its next training forward replaces every rank's buffers with rank 0's
    before using them. True compares them anyway (they differ after any step of a BatchNorm
    model, healthy or not); False never compares them.
    """
    if buffers not in (None, True, False):
        raise ValueError(f"buffers={buffers!r}: pass None (skip them when DDP broadcasts them), True or False")
    module = getattr(model, "module", model)  # a DDP wrapper or the bare model, same names
    if buffers is None:
        buffers = not (isinstance(model, DistributedDataParallel) and _syncs_buffers(model))
    buffer_names = {n for n, _ in module.named_buffers()}
    names, hashes, unchecked = [], [], []
    for name, t in module.state_dict(keep_vars=False).items():
        if name in buffer_names and not buffers:
            unchecked.append(name)
            continue
        names.append(name)
        hashes.append(tensor_hash(t))
    if not (dist.is_available() and dist.is_initialized()):
        return ReplicaReport(True, world_size=1, unchecked=unchecked)
    mine = torch.tensor(hashes, dtype=torch.int64, device=_device(group))
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)  # gloo and NCCL alike (NCCL wants it on the GPU)
    ref = gathered[0]
    ranks = [r for r in range(world) if not torch.equal(gathered[r], ref)]
    tensors = [n for i, n in enumerate(names) if any(g[i] != ref[i] for g in gathered)]
    return ReplicaReport(not ranks, ranks, tensors, world, unchecked)


def finite_everywhere(*tensors: torch.Tensor, group=None) -> tuple[bool, list]:
    """(True, []) when the tensors are finite on every rank, else (False, ranks that are not).

    Collective: all-gathers one flag per rank, so every rank takes the same decision (skip the
    step together; a rank that skipped backward alone would leave the others waiting in DDP's
    all-reduce). It costs a host sync and an all_gather: a tool for naming the bad rank. To skip
    bad steps in training, test the gradient norm after backward (see the module docstring).
    """
    flag = float(all(bool(torch.isfinite(t).all()) for t in tensors))
    if not (dist.is_available() and dist.is_initialized()):
        return bool(flag), ([] if flag else [0])
    flag = torch.tensor([flag], device=_device(group))
    world = dist.get_world_size(group)
    flags = [torch.empty_like(flag) for _ in range(world)]
    dist.all_gather(flags, flag, group=group)
    bad = [r for r, f in enumerate(flags) if f.item() == 0.0]
    return not bad, bad


def _syncs_buffers(ddp_model) -> bool:
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (the old name is an alias)
    return bool(getattr(ddp_model, "forward_sync_buffers", getattr(ddp_model, "broadcast_buffers", True)))


def _device(group) -> str:
    """NCCL collectives take CUDA tensors, gloo CPU tensors."""
    return f"cuda:{torch.cuda.current_device()}" if dist.get_backend(group) == "nccl" else "cpu"


# ---------------------------------------------------------------- what notebook 07 breaks
LATE_RANK = 1  # nb07_collectives: the rank that never reaches the monitored barrier


class TwoHeads(nn.Module):
    """The auxiliary head runs only on even steps: its parameters get no gradient on odd ones."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, use_aux):
        h = torch.relu(self.body(x))
        return self.head(h) + (self.aux(h) if use_aux else 0)


class Twice(nn.Module):
    """One layer used twice, each use in its own checkpointed block (weight sharing)."""

    def __init__(self, reentrant):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.reentrant = reentrant

    def block(self, h):
        return torch.relu(self.shared(h))

    def forward(self, x):
        h = self.inp(x)
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.out(h)
