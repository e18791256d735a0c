"""A scaling model for DDP: step time = work that divides + work that does not + exposed comm.

    from ddp_lab import profiling_model as pm
    pm.predict(parts_1, n=4, nbytes=8.7e6, buckets=2, alpha=a, beta=b, overlap=0.4)
    pm.cluster(params=25.6e6, n=8, link="100 Gb/s Ethernet", compute_ms=200, overlap=0.7)

With a fixed global batch split over N ranks (strong scaling), each rank's forward, backward
and data loading shrink like 1/N; the optimizer step does not (every rank updates the whole
model), nor does the per-step overhead. Communication is the ring all-reduce of the gradients
(ddp_lab.costmodel, alpha-beta), one call per bucket, of which the share `overlap` hides under
backward. The what-if part uses documented link figures (LINKS), not measurements.
"""
from __future__ import annotations

import math

from ddp_lab import costmodel

DIVIDES = ("data", "forward", "backward")      # per-rank work that shrinks with the batch shard
FIXED = ("optimizer", "other")                  # the same on every rank, whatever N is

# Nominal per-direction bandwidth of the slowest link a ring crosses (vendor specifications),
# and a round per-message latency assumed for each. Documented figures, not measured here;
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
    """Ring all-reduce of nbytes in `buckets` calls: every call pays the latency term."""
    if n <= 1:
        return 0.0
    per = nbytes / buckets
    return float(buckets * costmodel.ring(per, n, alpha, beta))


def predict(parts_1: dict, n: int, nbytes: float, alpha: float, beta: float, overlap: float,
            buckets: int = 1, devices: int | None = None) -> dict:
    """Predicted seconds per step on n ranks from the one-rank budget `parts_1` (seconds of
    data, forward, backward, optimizer, other). devices: how many ranks really run at once
    (the CPU cores); None means one device per rank."""
    share = max(1.0, n / devices) if devices else 1.0   # ranks per device: they take turns
    divides = sum(parts_1.get(k, 0.0) for k in DIVIDES) / n * share
    fixed = sum(parts_1.get(k, 0.0) for k in FIXED) * share
    comm = allreduce_s(nbytes, n, alpha, beta, buckets)
    exposed = (1 - overlap) * comm
    return {"divides": divides, "fixed": fixed, "comm": comm, "exposed comm": exposed,
            "step": divides + fixed + exposed}


def cluster(params: float, n: int, link: str, compute_ms: float, overlap: float,
            grad_bytes: int = 4, bucket_mb: float = 25.0, fixed_ms: float = 0.0) -> dict:
    """What-if for a real cluster. compute_ms: forward + backward of the global batch on ONE
    device (an input: measure it on one GPU); fixed_ms: optimizer and overhead per step.
    grad_bytes 2 models fp16/bf16 gradient compression; bucket_mb sets the number of calls."""
    bw, alpha = LINKS[link]
    nbytes = params * grad_bytes
    buckets = max(1, math.ceil(nbytes / (bucket_mb * 2**20)))
    comm = allreduce_s(nbytes, n, alpha, 1 / bw, buckets)
    step = compute_ms / 1e3 / n + fixed_ms / 1e3 + (1 - overlap) * comm
    one = compute_ms / 1e3 + fixed_ms / 1e3
    return {"step_ms": step * 1e3, "comm_ms": comm * 1e3, "exposed_ms": (1 - overlap) * comm * 1e3,
            "buckets": buckets, "speedup": one / step, "efficiency": one / step / n}


def cluster_table(params, n, compute_ms, overlap, links=None, grad_bytes=4, **kw) -> list:
    """Rows for a static table: one per link; speedup_bf16 is the same with bf16 gradients."""
    rows = []
    for link in links or LINKS:
        row = cluster(params, n, link, compute_ms, overlap, grad_bytes=grad_bytes, **kw)
        bf16 = cluster(params, n, link, compute_ms, overlap, grad_bytes=2, **kw)
        rows.append({"link": link, **row, "speedup_bf16": bf16["speedup"]})
    return rows


def format_table(rows, n) -> str:
    lines = [f"{'link (documented figure)':<28}{'comm ms':>9}{'exposed':>9}{'step ms':>9}"
             f"{'speedup':>9}{'eff.':>6}{'bf16 grads':>11}"]
    for r in rows:
        lines.append(f"{r['link']:<28}{r['comm_ms']:>9.1f}{r['exposed_ms']:>9.1f}{r['step_ms']:>9.1f}"
                     f"{r['speedup']:>8.1f}x{r['efficiency']:>6.0%}{r['speedup_bf16']:>10.1f}x")
    return "\n".join(lines)


def calculator(params=25.6e6, n=8, compute_ms=200.0, overlap=0.7):
    """An ipywidgets form over cluster(); returns the widget (needs a running kernel)."""
    import ipywidgets as W

    w = {"params": W.FloatLogSlider(value=params, base=10, min=6, max=10, description="params"),
         "n": W.IntSlider(value=n, min=1, max=64, description="GPUs"),
         "link": W.Dropdown(options=list(LINKS), value="100 Gb/s Ethernet", description="link"),
         "compute_ms": W.FloatSlider(value=compute_ms, min=5, max=2000, step=5, description="1-GPU ms"),
         "overlap": W.FloatSlider(value=overlap, min=0, max=1, step=0.05, description="overlap"),
         "grad_bytes": W.Dropdown(options=[("fp32 grads", 4), ("bf16 grads", 2)], value=4,
                                  description="gradients"),
         "bucket_mb": W.FloatLogSlider(value=25, base=2, min=0, max=9, description="bucket MB")}
    out = W.HTML()

    def show(_=None):
        r = cluster(**{k: v.value for k, v in w.items()})
        out.value = (f"<pre>{w['n'].value} GPUs: step {r['step_ms']:.1f} ms (all-reduce {r['comm_ms']:.1f} ms"
                     f" in {r['buckets']} bucket(s), {r['exposed_ms']:.1f} ms exposed)\n"
                     f"speedup {r['speedup']:.2f}x, scaling efficiency {r['efficiency']:.0%}</pre>")

    for v in w.values():
        v.observe(show, "value")
    show()
    return W.VBox([*w.values(), out])
