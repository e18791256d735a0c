"""All-reduce, step by step: a simulation you can read, and the same ring on real processes.

    from ddp_lab.lessons import ring
    sim = ring.simulate([t0, t1, t2, t3], algorithm="ring")
    sim.outputs          # what every rank holds at the end (the elementwise sum)
    sim.bytes_sent       # bytes each rank put on the wire
    sim.steps            # per step: [Message(src, dst, chunk, nbytes, op), ...]
    sim.holdings[s]      # after step s: [rank][chunk] -> set of ranks summed into it

Three algorithms:
- "naive": everyone sends to rank 0, rank 0 adds and sends the sum back. Rank 0's
  link carries (N-1)*S bytes each way, so it gets slower with every rank you add.
- "ring_unchunked": whole tensors travel round the ring, as in PyTorch's
  "Writing Distributed Applications" tutorial. No hot spot, but each rank sends (N-1)*S.
- "ring": cut the tensor into N chunks; reduce-scatter (N-1 steps), then
  all-gather (N-1 steps). Each rank sends 2(N-1)/N*S: almost independent of N.

A step is one round in which every sender can talk at once (one message per
link), so time is about (steps * alpha + bytes per step * beta): see ddp_lab.lessons.costmodel.
all_reduce_p2p() runs the chunked ring with torch.distributed send/recv.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    chunk: int      # chunk index (always 0 for the unchunked algorithms)
    nbytes: int
    op: str         # "reduce" (receiver adds it) or "copy" (receiver overwrites)


@dataclass
class Simulation:
    algorithm: str
    n: int
    outputs: list
    bytes_sent: list
    bytes_received: list
    steps: list                      # list of lists of Message
    phases: list                     # phase name of each step
    chunk_bounds: list               # [(start, stop)] per chunk, in elements of the flat tensor
    holdings: list = field(default_factory=list)  # holdings[0] = before any step

    @property
    def nbytes(self) -> int:
        """S: bytes of one rank's input tensor."""
        return int(self.outputs[0].size * self.outputs[0].itemsize) if self.outputs else 0


def chunk_bounds(numel: int, n: int) -> list:
    """n nearly equal chunks (sizes differ by at most one element), like np.array_split."""
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _as_numpy(t):
    if hasattr(t, "detach"):  # torch tensor, without importing torch here
        return t.detach().cpu().numpy()
    return np.asarray(t)


def simulate(tensors, algorithm: str = "ring") -> Simulation:
    """All-reduce (sum) of one tensor per rank, message by message."""
    if algorithm not in ("ring", "naive", "ring_unchunked"):
        raise ValueError(f"algorithm must be 'ring', 'naive' or 'ring_unchunked', not {algorithm!r}")
    arrays = [_as_numpy(t) for t in tensors]
    if not arrays:
        raise ValueError("give one tensor per rank (the list is empty)")
    shape = arrays[0].shape
    if any(a.shape != shape for a in arrays):
        raise ValueError(f"every rank needs the same shape; got {[a.shape for a in arrays]}")
    n = len(arrays)
    # Each rank's working buffer (flat), what it is sending, and whose values it holds.
    buf = [a.astype(a.dtype, copy=True).reshape(-1) for a in arrays]
    item = buf[0].itemsize
    nchunks = n if algorithm == "ring" else 1
    bounds = chunk_bounds(buf[0].size, nchunks)
    held = [[{r} for _ in range(nchunks)] for r in range(n)]
    sim = Simulation(algorithm, n, [], [0] * n, [0] * n, [], [], bounds, [_copy(held)])

    def run_step(phase, messages):
        # Every message of a step reads the senders' state before anyone writes: a real round.
        payload = []
        for m in messages:
            lo, hi = bounds[m.chunk]
            payload.append((buf[m.src][lo:hi].copy(), set(held[m.src][m.chunk])))
        for m, (data, who) in zip(messages, payload):
            lo, hi = bounds[m.chunk]
            if m.op == "reduce":
                buf[m.dst][lo:hi] += data
                held[m.dst][m.chunk] |= who
            else:
                buf[m.dst][lo:hi] = data
                held[m.dst][m.chunk] = set(who)
            sim.bytes_sent[m.src] += m.nbytes
            sim.bytes_received[m.dst] += m.nbytes
        sim.steps.append(messages)
        sim.phases.append(phase)
        sim.holdings.append(_copy(held))

    def msg(src, dst, chunk, op):
        lo, hi = bounds[chunk]
        return Message(src, dst, chunk, (hi - lo) * item, op)

    if algorithm == "ring":
        # Reduce-scatter: at step s rank r passes chunk (r - s) to its right neighbour, which
        # adds its own part. After N-1 steps rank r owns the full sum of chunk (r + 1) % N.
        for s in range(n - 1):
            run_step("reduce-scatter", [msg(r, (r + 1) % n, (r - s) % n, "reduce") for r in range(n)])
        # All-gather: the finished chunks travel round the ring once more, copied, not added.
        for s in range(n - 1):
            run_step("all-gather", [msg(r, (r + 1) % n, (r + 1 - s) % n, "copy") for r in range(n)])
    elif algorithm == "ring_unchunked":
        # The tutorial's version: forward what you just received, add it to your own sum.
        # Kept in `buf` is the accumulated sum; `fwd` is the tensor in flight.
        fwd = [b.copy() for b in buf]
        fwd_who = [{r} for r in range(n)]
        for _ in range(n - 1):
            new_fwd = [fwd[(r - 1) % n] for r in range(n)]
            new_who = [fwd_who[(r - 1) % n] for r in range(n)]
            for r in range(n):
                buf[r] += new_fwd[r]
                held[r][0] |= new_who[r]
                sim.bytes_sent[r] += new_fwd[r].size * item
                sim.bytes_received[r] += new_fwd[r].size * item
            fwd, fwd_who = new_fwd, new_who
            sim.steps.append([Message(r, (r + 1) % n, 0, buf[r].size * item, "reduce") for r in range(n)])
            sim.phases.append("pass round the ring")
            sim.holdings.append(_copy(held))
    else:  # naive: rank 0's single link is the bottleneck, so its messages go one at a time
        for src in range(1, n):
            run_step("reduce to rank 0", [msg(src, 0, 0, "reduce")])
        for dst in range(1, n):
            run_step("broadcast from rank 0", [msg(0, dst, 0, "copy")])
    sim.outputs = [b.reshape(shape) for b in buf]
    return sim


def collective_bytes(op: str, n: int, nbytes: float) -> float:
    """Bytes one rank sends in a ring collective over n ranks, S = nbytes the whole tensor:
    all_reduce 2(n-1)/n*S (a reduce-scatter, then an all-gather), reduce_scatter and all_gather
    (n-1)/n*S each (S is the full tensor: the input of a reduce-scatter, the output of an all-gather)."""
    share = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}
    if op not in share:
        raise ValueError(f"op must be one of {sorted(share)}, not {op!r}")
    return share[op] * (n - 1) / n * nbytes


def _copy(held):
    return [[set(c) for c in row] for row in held]


def all_reduce_p2p(tensor, group=None) -> dict:
    """Sum `tensor` in place over `group` with the chunked ring, built from send/recv.

    Every rank of the group must call it. Returns {"bytes_sent": ..., "steps": ...} so the
    caller can compare with simulate(). Same schedule as simulate(..., "ring").
    """
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    right, left = to_global((me + 1) % n), to_global((me - 1) % n)
    flat = tensor.view(-1)
    chunks = [flat[lo:hi] for lo, hi in chunk_bounds(flat.numel(), n)]
    sent = 0
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            send_i = (me - s) % n if phase == "reduce-scatter" else (me + 1 - s) % n
            recv_i = (send_i - 1) % n  # what my left neighbour sends this step
            inbox = torch.empty_like(chunks[recv_i])
            # isend first, then recv: with a blocking send every rank would wait on its
            # neighbour's recv and the ring would deadlock.
            req = dist.isend(chunks[send_i].contiguous(), right, group=group)
            dist.recv(inbox, left, group=group)
            req.wait()
            sent += chunks[send_i].numel() * chunks[send_i].element_size()
            if phase == "reduce-scatter":
                chunks[recv_i].add_(inbox)
            else:
                chunks[recv_i].copy_(inbox)
    return {"bytes_sent": sent, "steps": 2 * (n - 1)}
