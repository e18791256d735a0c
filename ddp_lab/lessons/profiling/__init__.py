"""Where the time of a DDP step goes, read from torch.profiler's Chrome traces (notebook 08).

    from ddp_lab.lessons import profiling
    trace = profiling.load("runs/08_profiling/wide_n2/rank0.json")
    steps = profiling.steps(trace)         # one Step per annotated training step
    profiling.budget(steps[0])             # seconds of forward, backward, comm, ... in that step

The training loop marks its phases with torch.profiler.record_function, named as in PHASES:

    with record_function("ddp_lab/step"):
        with record_function("ddp_lab/data"):      x, y = next(batches)
        with record_function("ddp_lab/forward"):   loss = loss_fn(model(x), y)
        with record_function("ddp_lab/backward"):  loss.backward()
        with record_function("ddp_lab/optimizer"): optimizer.step(); optimizer.zero_grad()

Everything else comes from the trace itself. On a CPU trace, the autograd engine's
`evaluate_function` events are backward's compute (less the `c10d::` calls inside them, which hand
a bucket to the process group and can block), and the all-reduces are the process group's own
events (`gloo:all_reduce` on gloo's worker threads). A bucket's all-reduce runs on another thread
while backward goes on, so communication is split into the part hidden under compute and the part
the main thread really waited for (exposed).

On a GPU trace (kineto's JSON with `"cat": "kernel"` events) the CPU spans only measure kernel
launches, so the budget is taken from the device: a kernel belongs to the phase whose span holds
its launch (`cudaLaunchKernel`, matched by `args.correlation`; backward's launches come from the
autograd engine's device thread, inside the main thread's backward span), NCCL kernels are the
communication, and the parts split the device's time from the step's first kernel to its last:
"other" is then time the GPU sat idle.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "ddp_lab/"
PHASES = ("data", "forward", "backward", "optimizer")
PARTS = ("data", "forward", "backward", "optimizer", "exposed comm", "other")
_COMM = re.compile(r"^(gloo|nccl):all_reduce$")
_BACKWARD_OP = "autograd::engine::evaluate_function:"
_ENQUEUE = "c10d::"  # a collective being handed to the process group: waiting, not compute


# ---- intervals: sorted lists of disjoint (start, end) pairs, in microseconds ----------------

def union(pairs) -> list:
    out = []
    for s, e in sorted(pairs):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        elif e > s:
            out.append((s, e))
    return out


def intersect(a, b) -> list:
    a, b, out, i, j = union(a), union(b), [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list:
    out = []
    for s, e in union(a):
        for bs, be in union(b):
            if be <= s or bs >= e:
                continue
            if bs > s:
                out.append((s, bs))
            s = max(s, be)
            if s >= e:
                break
        if s < e:
            out.append((s, e))
    return out


def length(pairs) -> float:
    return sum(e - s for s, e in union(pairs))


# ---- the trace ------------------------------------------------------------------------------

def load(path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def rank_of(trace: dict) -> int:
    return int(trace.get("distributedInfo", {}).get("rank", 0))


@dataclass
class Step:
    """One training step of one rank; times in microseconds on the trace's clock."""
    rank: int
    start: float
    end: float
    phases: dict = field(default_factory=dict)        # name -> (start, end)
    backward_ops: list = field(default_factory=list)  # disjoint intervals of backward compute
    comm: list = field(default_factory=list)          # all-reduce intervals (one per bucket)
    kernels: dict = field(default_factory=dict)       # GPU traces: phase -> its compute kernels' intervals
    on_gpu: bool = False                              # the trace has kernels: budget the device's time

    @property
    def dur(self) -> float:
        return self.end - self.start


def _events(trace):
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _is_kernel(e):
    return e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")


def _is_nccl(e):
    return _is_kernel(e) and "nccl" in e.get("name", "").lower()


def comm_events(trace) -> list:
    """All-reduce intervals: the process group's CPU events, or NCCL kernels on a GPU trace."""
    ev = _events(trace)
    kernels = [e for e in ev if _is_nccl(e)]
    # with NCCL the CPU event only enqueues the kernel: the kernel is the transfer
    chosen = kernels or [e for e in ev if _COMM.match(e.get("name", "")) and not _is_kernel(e)]
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in chosen)


def _launched_at(ev) -> dict:
    """id(kernel event) -> when the CPU launched it (its runtime call with the same correlation)."""
    calls = {e["args"]["correlation"]: e["ts"] for e in ev
             if not _is_kernel(e) and "correlation" in e.get("args", {})}
    return {id(k): calls.get(k.get("args", {}).get("correlation"), k["ts"]) for k in ev if _is_kernel(k)}


def steps(trace: dict, prefix: str = PREFIX) -> list:
    """The annotated steps of one rank's trace, in time order."""
    ev = _events(trace)
    marks = [e for e in ev if e.get("name", "").startswith(prefix) and not _is_kernel(e)
             and e.get("cat") != "gpu_user_annotation"]
    comm = comm_events(trace)
    # backward runs on the calling thread for CPU tensors, on the engine's device thread for CUDA
    cpu = [e for e in ev if not _is_kernel(e)]
    enqueue = [(e["ts"], e["ts"] + e["dur"]) for e in cpu if e.get("name", "").startswith(_ENQUEUE)]
    bwd = subtract([(e["ts"], e["ts"] + e["dur"]) for e in cpu
                    if e.get("name", "").startswith(_BACKWARD_OP)], enqueue)
    launched = _launched_at(ev)
    compute_kernels = [e for e in ev if _is_kernel(e) and not _is_nccl(e)]
    nccl_kernels = [e for e in ev if _is_nccl(e)]
    out = []
    for m in sorted((e for e in marks if e["name"] == prefix + "step"), key=lambda e: e["ts"]):
        s, t = m["ts"], m["ts"] + m["dur"]
        step = Step(rank_of(trace), s, t)
        for e in marks:
            name = e["name"][len(prefix):]
            if name in PHASES and s <= e["ts"] < t:
                step.phases[name] = (e["ts"], e["ts"] + e["dur"])
        if "backward" in step.phases:
            step.backward_ops = intersect(bwd, [step.phases["backward"]])
        step.comm = [(a, b) for a, b in comm if s <= a < t]
        if compute_kernels or nccl_kernels:
            step.on_gpu = True
            mine = lambda k: s <= launched[id(k)] < t
            step.comm = sorted((k["ts"], k["ts"] + k["dur"]) for k in nccl_kernels if mine(k))
            for name, (a, b) in step.phases.items():
                step.kernels[name] = union((k["ts"], k["ts"] + k["dur"]) for k in compute_kernels
                                           if mine(k) and a <= launched[id(k)] < b)
        out.append(step)
    return out


def _parts(busy: dict, comm: list, window: tuple) -> dict:
    """Disjoint parts of `window`: each busy kind (earlier kinds win where they overlap), comm
    while nothing was busy (exposed), and the rest (other)."""
    inside, taken, out = [window], [], {}
    for k, v in busy.items():
        part = subtract(intersect(v, inside), taken)
        out[k] = length(part) / 1e6
        taken = union(taken + part)
    out["exposed comm"] = length(intersect(subtract(comm, taken), inside)) / 1e6
    out["other"] = length(subtract(inside, taken + comm)) / 1e6
    out["comm"] = length(intersect(comm, inside)) / 1e6
    out["hidden comm"] = out["comm"] - out["exposed comm"]
    out["step"] = (window[1] - window[0]) / 1e6
    return out


def budget(step: Step) -> dict:
    """Seconds of each part of the step, parts that add up to the step. CPU trace: disjoint sets of
    instants of the main thread (forward, backward compute, optimizer and data; exposed comm is
    all-reduce time when none of those ran; other is what is left). GPU trace: the same split of
    the device's time, from the step's first kernel to its last, by kernels."""
    ph = step.phases
    if step.on_gpu:
        spans = [p for v in step.kernels.values() for p in v] + step.comm
        if not spans:
            raise ValueError(f"the step at ts={step.start} launched no CUDA kernel: put the step's CUDA work "
                             f"inside record_function({PREFIX + 'step'!r})")
        window = (min(a for a, _ in spans), max(b for _, b in spans))
        return _parts({k: step.kernels.get(k, []) for k in PHASES}, step.comm, window)
    busy = {"data": [ph["data"]] if "data" in ph else [],
            "forward": [ph["forward"]] if "forward" in ph else [],
            "backward": step.backward_ops,
            "optimizer": [ph["optimizer"]] if "optimizer" in ph else []}
    return _parts(busy, step.comm, (step.start, step.end))


def mean_budget(all_steps) -> dict:
    """Average of budget() over steps (of one rank, or of every rank)."""
    rows = [budget(s) for s in all_steps]
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def overlap_fraction(all_steps) -> float:
    """Share of all-reduce time hidden under compute, over the given steps."""
    rows = [budget(s) for s in all_steps]
    comm = sum(r["comm"] for r in rows)
    return sum(r["hidden comm"] for r in rows) / comm if comm else 0.0


def load_run(folder) -> dict:
    """{rank: [Step, ...]} for every rank*.json in a run folder."""
    out = {}
    for path in sorted(Path(folder).glob("rank*.json")):
        trace = load(path)
        out[rank_of(trace)] = steps(trace)
    return out


def merge(folder, out=None) -> Path:
    """One trace with every rank as its own process ("rank R"), so Perfetto or chrome://tracing
    shows the ranks one above the other (the ranks of one machine share its clock)."""
    folder = Path(folder)
    events = []
    for path in sorted(folder.glob("rank*.json")):
        trace = load(path)
        r = rank_of(trace)
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for e in trace.get("traceEvents", []):
            if e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index", "process_labels"):
                continue
            events.append({**e, "pid": r})
    out = Path(out) if out else folder / "all_ranks.json"
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), encoding="utf-8")
    return out


@contextmanager
def captured_stderr():
    """The lines C++ code writes to file descriptor 2 inside the block, filled in when it ends.
    torch's C++ warnings (the profiler's allocator notes) bypass Python's `warnings` and
    `sys.stderr`, so only the descriptor itself can catch them; Python's own output is untouched."""
    lines: list = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())
