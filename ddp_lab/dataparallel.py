"""nn.DataParallel's training step, re-enacted on the CPU so it can be watched and counted.

On a machine without CUDA, nn.DataParallel(model) has device_ids == [] and its
forward simply calls the wrapped module: nothing is parallel. dp_step() does by
hand what it does with GPUs, in the same order:

    scatter    split the batch; send chunk i from device 0 to device i
    replicate  copy every parameter and buffer from device 0 to each device (every step!)
    parallel   one *thread* per device runs its replica's forward (one process, one GIL)
    gather     concatenate the outputs on device 0, compute the loss there
    backward   send each output-gradient chunk back; sum every replica's
               parameter gradients onto device 0 (the only copy the optimizer updates)

"Devices" are simulated: a Traffic ledger counts the bytes each one would send
and receive. ring_allreduce() counts the same for DDP's ring all-reduce, so
the two can be compared as N grows (see the analytic dp_bytes / ddp_bytes).
"""
from __future__ import annotations

import copy
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ddp_lab import ring


@dataclass
class Traffic:
    """Bytes each of n simulated devices sends and receives, and by which phase."""
    n: int
    sent: list = field(default_factory=list)
    received: list = field(default_factory=list)
    by_phase: dict = field(default_factory=dict)

    def __post_init__(self):
        self.sent = [0] * self.n
        self.received = [0] * self.n

    def move(self, phase: str, src: int, dst: int, nbytes: int) -> None:
        if src == dst:
            return  # data already where it is needed: no transfer
        self.sent[src] += nbytes
        self.received[dst] += nbytes
        self.by_phase[phase] = self.by_phase.get(phase, 0) + nbytes

    def through(self, device: int) -> int:
        """Bytes in and out of one device."""
        return self.sent[device] + self.received[device]

    def busiest(self) -> tuple[int, int]:
        """(device, bytes through it) for the device that moves the most."""
        return max(((d, self.through(d)) for d in range(self.n)), key=lambda t: t[1])


def dataparallel_on_cpu(model: nn.Module, x: torch.Tensor) -> dict:
    """What nn.DataParallel does when no CUDA device is visible."""
    dp = nn.DataParallel(model)
    calls = []
    handle = model.register_forward_hook(lambda m, i, o: calls.append(threading.get_ident()))
    try:
        out_dp, out_plain = dp(x), model(x)
    finally:
        handle.remove()
    return {"device_ids": list(dp.device_ids), "module_is_model": dp.module is model,
            "forward_calls": len(calls), "same_thread": len(set(calls)) == 1,
            "outputs_equal": torch.equal(out_dp, out_plain)}


@dataclass
class StepReport:
    loss: float
    traffic: Traffic
    pids: list
    threads: list
    forward_s: list  # seconds each replica's forward took in its thread


def dp_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_devices: int,
            threaded: bool = True) -> StepReport:
    """One DataParallel training step over n_devices simulated devices.

    Leaves the summed gradient in model's .grad, as nn.DataParallel does on device 0.
    """
    n = n_devices
    traffic = Traffic(n)
    # 1. scatter: the whole batch lives on device 0; chunk i goes to device i
    chunks = list(x.tensor_split(n))
    for i in range(1, n):
        traffic.move("scatter inputs", 0, i, chunks[i].nbytes)
    # 2. replicate: clone() is differentiable, so each replica's gradients flow back
    #    and are *summed* into the original parameters, like DataParallel's Broadcast.
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    replicas = [(model, state)]
    for i in range(1, n):
        replicas.append((copy.deepcopy(model), {k: v.clone() for k, v in state.items()}))
        traffic.move("replicate weights", 0, i, sum(v.nbytes for v in state.values()))
    # 3. parallel forward: threads of this one process (parallel_apply does the same)
    outputs, pids, threads, forward_s = [None] * n, [None] * n, [None] * n, [0.0] * n
    all_alive = threading.Barrier(n if threaded else 1)

    def work(i):
        t0 = time.perf_counter()
        module, params = replicas[i]
        outputs[i] = functional_call(module, params, (chunks[i],))
        forward_s[i] = time.perf_counter() - t0
        all_alive.wait()  # so thread ids are not reused: all n threads exist at once
        pids[i], threads[i] = os.getpid(), threading.get_ident()

    if threaded:
        workers = [threading.Thread(target=work, args=(i,)) for i in range(n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    else:
        for i in range(n):
            work(i)
    # 4. gather outputs on device 0; the loss is computed there only
    for i in range(1, n):
        traffic.move("gather outputs", i, 0, outputs[i].nbytes)
    loss = F.cross_entropy(torch.cat(outputs), y)
    # 5. backward: output-gradients scatter back, parameter gradients reduce onto device 0
    model.zero_grad(set_to_none=True)
    loss.backward()
    grad_bytes = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    for i in range(1, n):
        traffic.move("scatter output grads", 0, i, outputs[i].nbytes)
        traffic.move("reduce grads", i, 0, grad_bytes)
    return StepReport(loss.item(), traffic, pids, threads, forward_s)


def ring_allreduce(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Traffic]:
    """Sum n equal-shaped tensors with a ring all-reduce, counting every byte.

    The schedule is ddp_lab.ring.simulate's (reduce-scatter, then all-gather; notebook 03
    steps through it); here its messages fill the same Traffic ledger as DataParallel's
    step, so both are counted alike. Each device sends and receives 2(n-1)/n of the tensor.
    """
    sim = ring.simulate(tensors, "ring")
    traffic = Traffic(len(tensors))
    for phase, messages in zip(sim.phases, sim.steps):
        for m in messages:
            traffic.move(phase, m.src, m.dst, m.nbytes)
    out = [torch.from_numpy(o).view_as(t) for o, t in zip(sim.outputs, tensors)]
    return out, traffic


def dp_bytes(n: int, param_bytes: float, input_bytes: float, output_bytes: float,
             buffer_bytes: float = 0.0) -> float:
    """Analytic bytes through device 0 per DataParallel step (sent + received).

    replicate (n-1)(P+B) out, reduce grads (n-1)P in, scatter inputs and output
    grads (n-1)/n of X and O out, gather outputs (n-1)/n of O in.
    """
    return (n - 1) * (2 * param_bytes + buffer_bytes) + (n - 1) / n * (input_bytes + 2 * output_bytes)


def ddp_bytes(n: int, param_bytes: float) -> float:
    """Analytic bytes through any one device per DDP step (ring: 2(n-1)/n P out and in)."""
    return 2 * 2 * (n - 1) / n * param_bytes
