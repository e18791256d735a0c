"""nn.DataParallel's training step, re-enacted on the CPU so it can be watched and counted.

On a machine without CUDA, nn.DataParallel(model) has device_ids == [] and its
forward simply calls the wrapped module: nothing is parallel. dp_step() does what
it does with GPUs, in the same order, with torch's own code wherever the CPU allows:

    scatter    split the batch that lives on device 0; chunk i goes to device i
    replicate  torch.nn.parallel.replicate: a new copy of every module for every
               device, and every parameter and buffer broadcast from device 0 (every step!)
    parallel   one *thread* per device runs its replica's forward (one process, one GIL)
    gather     concatenate the outputs on device 0, compute the loss there
    backward   the output gradients go back to each device; the replicas' parameter
               gradients are summed onto device 0, in one go, after all of backward

Only the copy between devices is replaced: replicate() calls a CUDA broadcast
(comm.broadcast_coalesced); here a CPU stand-in with the same autograd shape (one
node for all parameters, whose backward is the gradient reduce, like
comm.reduce_add_coalesced) copies the tensors and counts the bytes on a Traffic
ledger. Two schedules for those copies:

    "pipelined"  what NCCL does when it is available: broadcast and reduce travel a
                 chain of devices in chunks, so every link carries the tensor about once
    "copies"     the fallback without NCCL: device 0 copies to and from each device in turn

replicate_seconds() and cores_busy() measure two costs a CPU can show: building
the replicas in Python every step, and N threads sharing one interpreter lock.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.nn.functional as F
import torch.nn.parallel  # noqa: F401  (loads torch.nn.parallel.replicate below)
from torch import nn

from ddp_lab.lessons import ring

# The module, not the function of the same name that torch.nn.parallel exports.
_REPLICATE = sys.modules["torch.nn.parallel.replicate"]
SCHEDULES = ("pipelined", "copies")


@dataclass
class Traffic:
    """Bytes each of n simulated devices sends and receives, and by which phase."""
    n: int
    sent: list = field(default_factory=list)
    received: list = field(default_factory=list)
    by_phase: dict = field(default_factory=dict)
    device_phase: dict = field(default_factory=dict)  # (device, phase) -> bytes in + out

    def __post_init__(self):
        self.sent = [0] * self.n
        self.received = [0] * self.n

    def move(self, phase: str, src: int, dst: int, nbytes: int) -> None:
        if src == dst:
            return  # data already where it is needed: no transfer
        self.sent[src] += nbytes
        self.received[dst] += nbytes
        self.by_phase[phase] = self.by_phase.get(phase, 0) + nbytes
        for d in (src, dst):
            self.device_phase[d, phase] = self.device_phase.get((d, phase), 0) + nbytes

    def through(self, device: int, phases=None) -> int:
        """Bytes in and out of one device (only the given phases, if any)."""
        if phases is None:
            return self.sent[device] + self.received[device]
        return sum(self.device_phase.get((device, p), 0) for p in phases)

    def busiest(self, phases=None) -> tuple[int, int]:
        """(device, bytes through it) for the device that moves the most."""
        return max(((d, self.through(d, phases)) for d in range(self.n)), key=lambda t: t[1])


def dataparallel_on_cpu(model: nn.Module, x: torch.Tensor) -> dict:
    """What nn.DataParallel does when no CUDA device is visible. On a machine with GPUs the
    devices are hidden from DataParallel's lookup while it is built, so the same thing is shown."""
    with mock.patch("torch.nn.parallel.data_parallel._get_available_device_type", return_value=None):
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


class _Plan:
    """What the stand-in broadcast needs to know: devices, schedule, ledger, event log."""

    def __init__(self, n: int, schedule: str, traffic: Traffic, events: list, clock):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
        self.n, self.schedule, self.traffic, self.events, self.clock = n, schedule, traffic, events, clock

    def broadcast(self, tensors) -> list[list[torch.Tensor]]:
        """Copies of `tensors` for every device, moved as the schedule moves them."""
        nbytes = sum(t.nbytes for t in tensors)
        copies = [[t.clone() for t in tensors]]  # device 0 already holds them
        for i in range(1, self.n):
            src = i - 1 if self.schedule == "pipelined" else 0   # chain 0->1->2.. or star from 0
            copies.append([t.clone() for t in copies[src]])
            self.traffic.move("replicate weights", src, i, nbytes)
        return copies

    def reduce(self, per_device) -> list[torch.Tensor]:
        """Sum per_device[i][k] over devices i onto device 0, moved as the schedule moves them."""
        nbytes = sum(g.nbytes for g in per_device[0])
        if self.schedule == "copies" or self.n < 3:
            total = list(per_device[0])
            for i in range(1, self.n):
                self.traffic.move("reduce grads", i, 0, nbytes)
                total = [a + g for a, g in zip(total, per_device[i])]
            return total
        # NCCL's ring reduce to root 0: partial sums travel 1 -> 2 -> ... -> n-1 -> 0
        partial = list(per_device[1])
        for i in range(2, self.n):
            self.traffic.move("reduce grads", i - 1, i, nbytes)
            partial = [a + g for a, g in zip(partial, per_device[i])]
        self.traffic.move("reduce grads", self.n - 1, 0, nbytes)
        return [g + a for g, a in zip(per_device[0], partial)]


class _Broadcast(torch.autograd.Function):
    """CPU stand-in for torch.nn.parallel._functions.Broadcast.

    Forward: broadcast every tensor to every device (broadcast_coalesced).
    Backward: ONE call with every replica's gradients, which it sums onto device 0
    (reduce_add_coalesced). Autograd runs it only when all of them exist: at the end of backward.
    """

    @staticmethod
    def forward(ctx, plan, *tensors):
        ctx.plan, ctx.count = plan, len(tensors)
        return tuple(itertools.chain.from_iterable(plan.broadcast(tensors)))

    @staticmethod
    def backward(ctx, *grads):
        plan, k = ctx.plan, ctx.count
        plan.events.append(("reduce grads onto device 0", next(plan.clock)))
        per_device = [grads[i * k:(i + 1) * k] for i in range(plan.n)]
        return (None, *plan.reduce(per_device))


def replicate(model: nn.Module, n_devices: int, schedule: str = "pipelined",
              traffic: Traffic | None = None, events: list | None = None, clock=None) -> list[nn.Module]:
    """torch.nn.parallel.replicate(model, devices), with the CUDA broadcast swapped for
    the CPU stand-in. Returns one replica per device; gradients flow back to `model`."""
    plan = _Plan(n_devices, schedule, traffic or Traffic(n_devices),
                 events if events is not None else [], clock or itertools.count())

    def broadcast_reshape(tensors, devices, detach=False):
        if len(tensors) == 0:
            return []
        if detach:  # buffers such as BatchNorm's running statistics: copied, no gradient
            with torch.no_grad():
                return plan.broadcast([t.detach() for t in tensors])
        flat = _Broadcast.apply(plan, *tensors)
        k = len(tensors)
        return [list(flat[i * k:(i + 1) * k]) for i in range(len(devices))]

    with mock.patch.object(_REPLICATE, "_broadcast_coalesced_reshape", broadcast_reshape):
        return _REPLICATE.replicate(model, list(range(n_devices)))


@dataclass
class StepReport:
    loss: float
    traffic: Traffic
    pids: list
    threads: list
    forward_s: list       # seconds each replica's forward took in its thread
    events: list          # (what, tick) in the order autograd ran them during backward
    replicas: list        # the module copies this step built (the next step builds new ones)


def dp_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_devices: int,
            threaded: bool = True, schedule: str = "pipelined") -> StepReport:
    """One DataParallel training step over n_devices simulated devices.

    Leaves the summed gradient in model's .grad, as nn.DataParallel does on device 0.
    """
    n = n_devices
    traffic, events, clock = Traffic(n), [], itertools.count()
    # 1. scatter: the whole batch lives on device 0; chunk i goes to device i
    chunks = list(x.tensor_split(n))
    for i in range(1, n):
        traffic.move("scatter inputs", 0, i, chunks[i].nbytes)
    # 2. replicate, every step: new modules, parameters broadcast from device 0
    replicas = replicate(model, n, schedule, traffic, events, clock)
    # Witnesses for backward's progress: an event each time a layer's output gradient is
    # computed inside a replica. (A global hook: replicas share their hook dicts with `model`.)
    layer_of = {id(layer): i for i, replica in enumerate(replicas) for layer in replica.children()}

    def witness(module, inputs, out):
        i = layer_of.get(id(module))
        if i is not None and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: events.append((f"replica {i} layer gradient", next(clock))))

    # 3. parallel forward: threads of this one process (parallel_apply does the same)
    outputs, pids, threads, forward_s = [None] * n, [None] * n, [None] * n, [0.0] * n
    all_alive = threading.Barrier(n if threaded else 1)

    def work(i):
        t0 = time.perf_counter()
        outputs[i] = replicas[i](chunks[i])
        forward_s[i] = time.perf_counter() - t0
        all_alive.wait()  # so thread ids are not reused: all n threads exist at once
        pids[i], threads[i] = os.getpid(), threading.get_ident()

    handle = nn.modules.module.register_module_forward_hook(witness)
    try:
        if threaded:
            workers = [threading.Thread(target=work, args=(i,)) for i in range(n)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        else:
            for i in range(n):
                work(i)
    finally:
        handle.remove()
    # 4. gather outputs on device 0; the loss is computed there only
    for i in range(1, n):
        traffic.move("gather outputs", i, 0, outputs[i].nbytes)
        outputs[i].register_hook(  # the output gradient travels back to device i
            lambda g, i=i: traffic.move("scatter output grads", 0, i, g.nbytes))
    loss = F.cross_entropy(torch.cat(outputs), y)
    # 5. backward: ends with one reduce of every replica's gradients onto device 0
    model.zero_grad(set_to_none=True)
    loss.backward()
    return StepReport(loss.item(), traffic, pids, threads, forward_s, events, replicas)


def replicate_seconds(model: nn.Module, n_devices: int, repeats: int = 5) -> float:
    """Best-of-`repeats` seconds torch.nn.parallel.replicate spends building the replicas
    in Python: the broadcast is replaced by one that copies nothing, so no byte moves."""
    def no_copy(tensors, devices, detach=False):
        return [list(tensors) for _ in devices] if len(tensors) else []

    best = float("inf")
    with mock.patch.object(_REPLICATE, "_broadcast_coalesced_reshape", no_copy):
        for _ in range(repeats):
            t0 = time.perf_counter()
            _REPLICATE.replicate(model, list(range(n_devices)))
            best = min(best, time.perf_counter() - t0)
    return best


def forward_seconds(model: nn.Module, x: torch.Tensor, repeats: int = 5) -> float:
    """Best-of-`repeats` seconds of one forward pass (no gradient)."""
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(x)
            best = min(best, time.perf_counter() - t0)
    return best


def cores_busy(work, n_threads: int = 2, repeats: int = 20) -> float:
    """Cores that n_threads threads keep busy while each calls work() `repeats` times: the
    CPU seconds those threads use, summed, per wall-clock second from the first one's
    start to the last one's end (torch on one intra-op thread, so only they compute).

    Only one thread at a time can hold the interpreter lock, so threads running Python
    cannot keep more than one core busy, however many cores are free. Kernels that
    release the lock (big matrix products) can keep n_threads cores busy, if the
    machine has them free: a loaded machine lowers every figure, never raises it.
    Each thread counts its own CPU time, so other threads of this process (a kernel's,
    a library's) never add to the figure.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        work()  # warm-up
        go = threading.Barrier(n_threads)
        spans = []  # (wall start, wall end, CPU seconds) of each thread

        def loop():
            go.wait()
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(repeats):
                work()
            spans.append((w0, time.perf_counter(), time.thread_time() - c0))

        workers = [threading.Thread(target=loop) for _ in range(n_threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = max(s[1] for s in spans) - min(s[0] for s in spans)
        return sum(s[2] for s in spans) / wall
    finally:
        torch.set_num_threads(before)


def python_work(iterations: int = 2000) -> int:
    """Interpreter work and nothing else: what a forward does between its operators."""
    total = 0
    for i in range(iterations):
        total += i
    return total


def ring_allreduce(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Traffic]:
    """Sum n equal-shaped tensors with a ring all-reduce, counting every byte.

    The schedule is ddp_lab.lessons.ring.simulate's (reduce-scatter, then all-gather; notebook 03
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


def ddp_bytes(n: int, param_bytes: float) -> float:
    """Analytic bytes through any one device per DDP step (ring: 2(n-1)/n P out and in)."""
    return 2 * 2 * (n - 1) / n * param_bytes
