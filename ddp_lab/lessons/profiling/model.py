"""A scaling model for DDP: step time = work that divides + work that does not + exposed comm.

    from ddp_lab.lessons.profiling import model as pm
    pm.predict(parts_1, n=4, nbytes=8.7e6, buckets=2, alpha=a, beta=b, overlap=0.4)
    pm.cluster(params=25.6e6, n=8, link="100 Gb/s Ethernet", compute_ms=200, overlap=0.7)

Two regimes. With a fixed per-GPU batch (weak scaling, how DDP is usually run and what
notebook 05's learning-rate scaling assumes) every rank's forward and backward take as long
as on one GPU, and the global batch grows with N: the speedup is throughput, samples per
second against one GPU's. With a fixed global batch split over N ranks (strong scaling, what
predict() measures on this machine), each rank's forward, backward and data loading shrink
like 1/N, and so does the backward that communication can hide under. Either way the
optimizer step does not shrink (every rank updates the whole model), nor does the per-step
overhead. Communication is the ring all-reduce of the gradients
(ddp_lab.lessons.costmodel, alpha-beta), one call per bucket.

Communication can only hide under backward, and only after its bucket is full. Gradients appear
at a steady rate during backward, last layers first; DDP's first bucket is small (1 MB), the
others hold up to `bucket_cap_mb`; a bucket's all-reduce starts when its last gradient is ready
and the previous all-reduce is done. The last bucket is ready when backward ends, so its
all-reduce is always exposed. `overlap` (0-1) caps the hidden share further: the share of the
all-reduce time that really runs beside compute (contention for a shared device lowers it).

The what-if part uses LINKS: nominal bandwidths from vendor specifications, and per-message
latencies alpha that are assumptions (round figures, not from any datasheet).
"""
from __future__ import annotations

import math

from ddp_lab.lessons import costmodel, plural

DIVIDES = ("data", "forward", "backward")      # per-rank work that shrinks with the batch shard
FIXED = ("optimizer", "other")                  # the same on every rank, whatever N is
FIRST_BUCKET_BYTES = 2**20                      # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
# Backward's share of forward + backward: a layer's backward computes a gradient for its input and
# one for its weight, about twice forward's arithmetic (the 2N/4N FLOPs per token of Kaplan et al.,
# "Scaling Laws for Neural Language Models", 2020). A rule of thumb: measure it on your model.
BACKWARD_SHARE = 2 / 3
SCALINGS = {"weak": "fixed per-GPU batch (weak scaling)",
            "strong": "fixed global batch (strong scaling)"}

# link -> (bandwidth per direction of the slowest link a ring crosses, in B/s: the nominal figure
# from NVIDIA's A100/H100 datasheets, the PCIe 4.0/5.0 specifications and the Ethernet/InfiniBand
# line rates; per-message latency alpha in s: ASSUMED round figures, not documented anywhere).
# nccl-tests usually reaches a fraction of the nominal rate.
LINKS = {
    "NVLink 3 (A100, 300 GB/s)": (300e9, 10e-6),
    "NVLink 4 (H100, 450 GB/s)": (450e9, 10e-6),
    "PCIe 4.0 x16 (32 GB/s)": (32e9, 15e-6),
    "PCIe 5.0 x16 (64 GB/s)": (64e9, 15e-6),
    "25 Gb/s Ethernet": (25e9 / 8, 50e-6),
    "100 Gb/s Ethernet": (100e9 / 8, 30e-6),
    "400 Gb/s Ethernet": (400e9 / 8, 30e-6),
    "InfiniBand HDR (200 Gb/s)": (200e9 / 8, 5e-6),
    "InfiniBand NDR (400 Gb/s)": (400e9 / 8, 5e-6),
}


def allreduce_s(nbytes, n, alpha, beta, buckets=1):
    """Ring all-reduce of nbytes in `buckets` equal calls: every call pays the latency term."""
    if n <= 1:
        return 0.0
    per = nbytes / buckets
    return float(buckets * costmodel.ring(per, n, alpha, beta))


def ddp_buckets(nbytes, bucket_mb=25.0, first_bytes=FIRST_BUCKET_BYTES) -> list:
    """Bucket sizes in bytes, in the order DDP launches them: the first capped at 1 MB, the rest
    at bucket_mb MiB, spread evenly (real buckets end at parameter boundaries)."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}: DDP's default is 25")
    first = min(nbytes, first_bytes)
    rest = nbytes - first
    k = math.ceil(rest / (bucket_mb * 2**20))
    return [first] + ([rest / k] * k if k else [])


def comm_exposed(sizes, n, alpha, beta, t_backward, overlap=1.0) -> tuple:
    """(all-reduce seconds, exposed seconds) for buckets of `sizes` bytes (launch order) on n ranks,
    with backward taking t_backward seconds on each rank. At most `overlap` of the all-reduce time
    hides, and never more than what ran before backward ended."""
    if n <= 1 or not sizes:
        return 0.0, 0.0
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap is a share of the all-reduce time: give a value in [0, 1], not {overlap}")
    total, done, end, comm = sum(sizes), 0.0, 0.0, 0.0
    for size in sizes:
        done += size
        ready = t_backward * done / total if total else t_backward  # its last gradient appears
        took = float(costmodel.ring(size, n, alpha, beta))
        end = max(ready, end) + took                # one all-reduce at a time
        comm += took
    hideable = comm - max(0.0, end - t_backward)    # what ran while backward was still computing
    return comm, comm - min(overlap * comm, hideable)


def predict(parts_1: dict, n: int, nbytes: float, alpha: float, beta: float, overlap: float,
            buckets=1, devices: int | None = None) -> dict:
    """Predicted seconds per step on n ranks from the one-rank budget `parts_1` (seconds of
    data, forward, backward, optimizer, other). buckets: how many equal buckets, or their sizes
    in launch order. devices: how many ranks really run at once (the CPU cores); None means one
    device per rank."""
    share = max(1.0, n / devices) if devices else 1.0   # ranks per device: they take turns
    divides = sum(parts_1.get(k, 0.0) for k in DIVIDES) / n * share
    fixed = sum(parts_1.get(k, 0.0) for k in FIXED) * share
    sizes = [nbytes / buckets] * buckets if isinstance(buckets, int) else list(buckets)
    t_backward = parts_1.get("backward", 0.0) / n * share
    comm, exposed = comm_exposed(sizes, n, alpha, beta, t_backward, overlap)
    return {"divides": divides, "fixed": fixed, "comm": comm, "exposed comm": exposed,
            "step": divides + fixed + exposed}


def cluster(params: float, n: int, link: str, compute_ms: float, overlap: float,
            grad_bytes: int = 4, bucket_mb: float = 25.0, fixed_ms: float = 0.0,
            backward_share: float = BACKWARD_SHARE, scaling: str = "weak") -> dict:
    """What-if for a real cluster. compute_ms: forward + backward on ONE GPU (an input: measure
    it), of which backward_share is backward: of one GPU's own batch with scaling="weak" (fixed
    per-GPU batch, the default), of the whole global batch with scaling="strong" (fixed global
    batch, split over n). fixed_ms: optimizer and overhead per step. grad_bytes 2 models bf16
    gradient compression. speedup: samples per second against one GPU's (weak: n GPUs process
    n batches per step; strong: one)."""
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}: pick one of pm.LINKS ({', '.join(LINKS)})")
    if scaling not in SCALINGS:
        raise ValueError(f"unknown scaling {scaling!r}: 'weak' ({SCALINGS['weak']}) or "
                         f"'strong' ({SCALINGS['strong']})")
    bw, alpha = LINKS[link]
    sizes = ddp_buckets(params * grad_bytes, bucket_mb)
    shards = n if scaling == "strong" else 1        # how many GPUs one batch is split over
    compute = compute_ms / 1e3 / shards
    comm, exposed = comm_exposed(sizes, n, alpha, 1 / bw, compute * backward_share, overlap)
    step = compute + fixed_ms / 1e3 + exposed
    one = compute_ms / 1e3 + fixed_ms / 1e3
    speedup = n / shards * one / step               # batches per step, against one GPU's time
    return {"step_ms": step * 1e3, "comm_ms": comm * 1e3, "exposed_ms": exposed * 1e3,
            "backward_ms": compute * backward_share * 1e3, "buckets": len(sizes),
            "speedup": speedup, "efficiency": speedup / n, "scaling": scaling}


def cluster_table(params, n, compute_ms, overlap, links=None, grad_bytes=4, **kw) -> list:
    """Rows for a static table: one per link; speedup_bf16 is the same with bf16 gradients."""
    rows = []
    for link in links or LINKS:
        row = cluster(params, n, link, compute_ms, overlap, grad_bytes=grad_bytes, **kw)
        bf16 = cluster(params, n, link, compute_ms, overlap, grad_bytes=2, **kw)
        rows.append({"link": link, "alpha_us": LINKS[link][1] * 1e6, **row, "speedup_bf16": bf16["speedup"]})
    return rows


def format_table(rows, n) -> str:
    scaling = rows[0].get("scaling", "weak") if rows else "weak"
    lines = [f"{plural(n, 'GPU')}, {SCALINGS[scaling]}:",
             f"{'link (nominal bandwidth)':<28}{'α assumed':>10}{'comm ms':>9}{'exposed':>9}{'step ms':>9}"
             f"{'speedup':>9}{'eff.':>6}{'bf16 grads':>11}"]
    for r in rows:
        lines.append(f"{r['link']:<28}{r['alpha_us']:>8.0f}us{r['comm_ms']:>9.1f}{r['exposed_ms']:>9.1f}"
                     f"{r['step_ms']:>9.1f}{r['speedup']:>8.1f}x{r['efficiency']:>6.0%}{r['speedup_bf16']:>10.1f}x")
    return "\n".join(lines)


def calculator_text(params=25.6e6, n=8, link="100 Gb/s Ethernet", compute_ms=200.0, overlap=0.7,
                    grad_bytes=4, bucket_mb=25.0, scaling="weak") -> str:
    """What the calculator shows for these inputs (its update function)."""
    r = cluster(params, n, link, compute_ms, overlap, grad_bytes=grad_bytes, bucket_mb=bucket_mb,
                scaling=scaling)
    return (f"<pre>{plural(n, 'GPU')}, {SCALINGS[scaling]}: step {r['step_ms']:.1f} ms (all-reduce "
            f"{r['comm_ms']:.1f} ms in {plural(r['buckets'], 'bucket')}, {r['exposed_ms']:.1f} ms exposed; "
            f"backward {r['backward_ms']:.1f} ms per GPU)\n"
            f"speedup {r['speedup']:.2f}x, scaling efficiency {r['efficiency']:.0%}</pre>")


def _log_slider(W, value, base, lo, hi, step, **kw):
    """A FloatLogSlider whose grid (min + k*step) passes through `value`: the browser snaps the
    value to that grid, so a grid that misses it would show another number than the code's."""
    from ddp_lab.lessons.widgets import grid_min
    exp = math.log(value, base)
    return W.FloatLogSlider(value=value, base=base, min=grid_min(exp, lo, step), max=max(hi, exp), step=step, **kw)


def calculator(params=25.6e6, n=8, compute_ms=200.0, overlap=0.7, bucket_mb=25.0, scaling="weak",
               link="100 Gb/s Ethernet", grad_bytes=4):
    """An ipywidgets form over cluster(); returns the widget (needs a running kernel). Every control
    starts at the call's value exactly: each slider's grid passes through it."""
    if min(params, n, compute_ms, bucket_mb) <= 0 or not 0 <= overlap <= 1 or link not in LINKS:
        raise ValueError(f"calculator: params, n, compute_ms and bucket_mb are positive, overlap is in "
                         f"[0, 1] and link one of {', '.join(LINKS)}")
    import ipywidgets as W
    from ddp_lab.lessons.widgets import grid_min, runnable

    w = {"params": _log_slider(W, params, 10, 6, 10, 0.05, description="params"),
         "n": W.IntSlider(value=n, min=1, max=max(64, n), description="GPUs"),
         "link": W.Dropdown(options=list(LINKS), value=link, description="link"),
         "compute_ms": W.FloatSlider(value=compute_ms, min=grid_min(compute_ms, 5, 5), max=max(2000, compute_ms),
                                     step=5, description="1-GPU ms"),
         "overlap": W.FloatSlider(value=overlap, min=grid_min(overlap, 0, 0.05), max=1, step=0.05,
                                  description="overlap"),
         "grad_bytes": W.Dropdown(options=[("fp32 grads", 4), ("bf16 grads", 2)], value=grad_bytes,
                                  description="gradients"),
         "bucket_mb": _log_slider(W, bucket_mb, 2, 0, 9, 0.25, description="bucket MB"),
         "scaling": W.Dropdown(options=[(SCALINGS[k], k) for k in SCALINGS], value=scaling,
                               description="batch")}
    out = W.HTML()

    def show(_=None):
        out.value = calculator_text(**{k: v.value for k, v in w.items()})

    for v in w.values():
        v.observe(show, "value")
    show()
    return runnable(W, [*w.values(), out], "What-if calculator")
