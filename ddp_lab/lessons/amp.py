"""Mixed precision, made visible (notebook 04).

    from ddp_lab.lessons import amp
    amp.dtype_census(model, x, torch.bfloat16)      # which layers ran in bf16, which in fp32
    amp.ranges()                                    # fp32 / fp16 / bf16: max, smallest, eps
    amp.underflow_demo()                            # a gradient fp16 loses, loss scaling keeps
    amp.scaler_trace(steps=40, inf_at=(8,))         # GradScaler skipping a step and backing off
    amp.clip_demo()                                 # clip_grad_norm_ with and without unscale_
    amp.step_time(models.cnn(), x, y, "bf16")       # seconds per training step
    amp.saved_activation_bytes(model, x, y, "bf16") # bytes autograd keeps for backward, by dtype
    amp.matmul_time(1024, "bf16")                   # one large matrix product: what 16-bit units give
    amp.cpu_16bit_units()                           # does this CPU have bf16/fp16 matrix instructions?

Everything uses the device-neutral API, torch.amp.autocast(device_type, dtype)
and torch.amp.GradScaler(device): torch.cuda.amp.* (what both source articles
use) is deprecated and, without a GPU, disables itself with a warning and trains
in fp32.
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device_type: str = "cpu"):
    """torch.amp.autocast for "bf16"/"fp16"; a no-op context for "fp32"."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.amp.autocast(device_type=device_type, dtype=DTYPES[precision])


# ---------------------------------------------------------------- what autocast changes
def dtype_census(model: nn.Module, x: torch.Tensor, dtype=torch.bfloat16, y=None,
                 device_type: str = "cpu") -> list[dict]:
    """Run one forward under autocast; one row per leaf module (and the loss if y is given).

    Forward hooks see what each layer received and produced; the parameters
    themselves stay fp32 (autocast casts a copy of the weight for each op).
    """
    rows, hooks = [], []

    def hook(name):
        def record(module, inputs, output):
            t_in = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
            params = {p.dtype for p in module.parameters(recurse=False)}
            rows.append({"layer": name, "type": type(module).__name__,
                         "input": _short(t_in.dtype) if t_in is not None else "-",
                         "output": _short(output.dtype),
                         "params": ",".join(sorted(_short(d) for d in params)) or "-"})
        return record

    for name, module in model.named_modules():
        if not list(module.children()):
            hooks.append(module.register_forward_hook(hook(name)))
    try:
        with torch.no_grad(), torch.amp.autocast(device_type=device_type, dtype=dtype):
            out = model(x)
            if y is not None:
                loss = nn.functional.cross_entropy(out, y)
                rows.append({"layer": "loss", "type": "cross_entropy", "input": _short(out.dtype),
                             "output": _short(loss.dtype), "params": "-"})
    finally:
        for h in hooks:
            h.remove()
    return rows


def _short(dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
        dtype, str(dtype).replace("torch.", ""))


# ---------------------------------------------------------------- number formats
def ranges() -> dict:
    """Exponent/mantissa bits and the limits that matter for training, per format."""
    bits = {"fp32": (8, 23), "fp16": (5, 10), "bf16": (8, 7)}
    out = {}
    for name, dtype in DTYPES.items():
        fi = torch.finfo(dtype)
        out[name] = {"exponent_bits": bits[name][0], "mantissa_bits": bits[name][1],
                     "max": fi.max, "min_normal": fi.tiny,
                     "min_subnormal": fi.smallest_normal * 2.0 ** -bits[name][1],
                     "eps": fi.eps}
    return out


def underflow_demo(grad_value: float = 1e-8, scale: float = 2.0 ** 16) -> dict:
    """Backward through an fp16 layer whose upstream gradient is `grad_value`.

    Without scaling the fp16 gradient rounds to 0 (below fp16's smallest subnormal,
    ~6e-8); multiplying the loss by `scale` first lifts it into range, and
    dividing the fp32 result by `scale` afterwards recovers the true value.
    bf16 keeps fp32's 8 exponent bits, so it needs no scaling at all.
    """
    torch.manual_seed(0)
    layer = nn.Linear(16, 1, bias=False)
    x = torch.rand(4, 16)
    results = {}
    for label, s in (("fp32", None), ("fp16", 1.0), ("fp16 + scaling", scale), ("bf16", 1.0)):
        layer.zero_grad()
        ctx = autocast(label[:4]) if s is not None else contextlib.nullcontext()
        with ctx:
            out = layer(x)                      # fp16 output under autocast
        loss = out.float().sum() * grad_value   # tiny loss => tiny upstream gradient
        (loss * (s or 1.0)).backward()
        results[label] = (layer.weight.grad / (s or 1.0)).clone()
    return {"scale": scale, "grad_value": grad_value, **results}


# ---------------------------------------------------------------- GradScaler's dynamic scale
def scaler_trace(steps: int = 40, inf_at=(8,), init_scale: float = 2.0 ** 16,
                 growth_interval: int = 10, seed: int = 0) -> list[dict]:
    """Train a tiny fp16 model with GradScaler; poison the gradients at `inf_at`.

    Records, per step: the scale used, whether the optimizer really stepped
    (parameters changed) and the scale after update(). growth_interval is
    shortened from the default 2000 so the regrowth fits in a plot.
    """
    from ddp_lab.lessons import data, models

    torch.manual_seed(seed)
    X, Y = data.digits_tensors("train")
    model = models.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    trace = []
    for step in range(steps):
        idx = torch.randint(0, len(Y), (32,))
        optimizer.zero_grad(set_to_none=True)
        with autocast("fp16"):
            loss = nn.functional.cross_entropy(model(X[idx]), Y[idx])
        scale_used = scaler.get_scale()
        scaler.scale(loss).backward()
        if step in inf_at:  # what an overflow in fp16 looks like to the scaler
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        stepped = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        trace.append({"step": step, "scale": scale_used, "stepped": stepped,
                      "scale_after": scaler.get_scale(), "loss": loss.item()})
    return trace


# ---------------------------------------------------------------- clipping under AMP
def clip_demo(max_norm: float = 0.1, init_scale: float = 2.0 ** 16, lr: float = 0.1) -> dict:
    """One fp16 step, clipped three ways, from the same start and the same batch.

    reference: no scaler, so clip sees the true gradient (as in fp32 or bf16 training);
    unscale_first: scaler.unscale_(optimizer) then clip (the documented recipe);
    no_unscale: clip the *scaled* gradient, whose norm is `scale` times too big.
    Returns the norm clip_grad_norm_ saw and the size of the update each way.
    """
    from ddp_lab.lessons import data, models

    X, Y = data.digits_tensors("train")
    x, y = X[:64], Y[:64]
    out = {}
    for way in ("reference", "unscale_first", "no_unscale"):
        torch.manual_seed(0)
        model = models.mlp()
        start = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=way != "reference")
        with autocast("fp16"):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if way == "unscale_first":
            scaler.unscale_(optimizer)  # NEW: gradients back to their true size before clipping
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        scaler.step(optimizer)  # unscales here if unscale_ was not called
        scaler.update()
        update = torch.sqrt(sum(((p.detach() - s) ** 2).sum() for p, s in zip(model.parameters(), start)))
        out[way] = {"norm_seen": norm, "update_norm": update.item()}
    out["scale"] = init_scale
    return out


# ---------------------------------------------------------------- cost: time and activations
def saved_activation_bytes(model: nn.Module, x, y, precision: str = "fp32",
                           device_type: str = "cpu") -> dict:
    """Bytes autograd keeps for backward during one forward, by dtype.

    saved_tensors_hooks sees every tensor an op saves for its backward; we count
    each storage once (a view and its base share memory), and only the part
    the saved tensor spans (a batch sliced from a dataset tensor is not the
    whole dataset). Works on the CPU, where torch.cuda.max_memory_allocated
    cannot help.
    """
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        nbytes = t.numel() * t.element_size()
        seen[key] = (_short(t.dtype), max(nbytes, seen.get(key, ("", 0))[1]))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast(precision, device_type):
            loss = nn.functional.cross_entropy(model(x), y)
    by_dtype = {}
    for dtype, nbytes in seen.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    del loss
    return by_dtype


@contextlib.contextmanager
def _threads(n: int | None):
    """torch's CPU thread count set to n inside the block (None: unchanged)."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def step_time(model: nn.Module, x, y, precision: str = "fp32", steps: int = 5, warmup: int = 1,
              device_type: str = "cpu", threads: int | None = None) -> float:
    """Seconds per training step (forward, backward, SGD step): the fastest of `steps`, the
    one least disturbed by whatever else the machine is doing. threads=1 times on one CPU
    thread, which other busy programs disturb far less than a team of threads."""
    with _threads(threads):
        return _step_time(model, x, y, precision, steps, warmup, device_type)


def _step_time(model, x, y, precision, steps, warmup, device_type) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(device_type, enabled=precision == "fp16")
    times = []
    for i in range(warmup + steps):
        if device_type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast(precision, device_type):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if device_type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return min(times)


def matmul_time(n: int = 1024, precision: str = "fp32", steps: int = 5, device_type: str = "cpu",
                threads: int | None = None) -> float:
    """Seconds for one n x n matrix product in `precision` (the fastest of `steps`): the
    operation 16-bit matrix units (Tensor Cores, AMX) accelerate, without autocast's casts."""
    with _threads(threads):
        return _matmul_time(n, precision, steps, device_type)


def _matmul_time(n, precision, steps, device_type) -> float:
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device_type, DTYPES[precision]) for _ in range(2))
    times = []
    for i in range(steps + 1):
        if device_type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device_type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first product warms up
            times.append(time.perf_counter() - t0)
    return min(times)


def cpu_16bit_units() -> dict:
    """Which 16-bit matrix instructions this CPU offers PyTorch (None: this PyTorch cannot tell).

    AVX512-BF16 and AMX (Intel Xeon, 4th generation and later) run bf16 products fast;
    AMX-FP16 does the same for fp16. Without them, 16-bit values are converted and
    computed in fp32.
    """
    probes = {"AVX512-BF16": "_is_avx512_bf16_supported", "AMX (bf16)": "_is_amx_tile_supported",
              "AMX-FP16": "_is_amx_fp16_supported"}
    out = {}
    for name, fn in probes.items():
        probe = getattr(torch.cpu, fn, None)  # private helpers; absent in some builds
        out[name] = bool(probe()) if probe is not None else None
    return out
