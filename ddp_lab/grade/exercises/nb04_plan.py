"""04.5: the autocast dtype and whether to use a GradScaler, per device; graded in the kernel.

The reference is measured, not a table: the plan's dtype runs section 2's underflow probe
(an upstream gradient of 1e-8 through a linear layer under autocast, scaled by 2^16 when the plan
uses a scaler) and the gradient must come back as the fp32 one.
"""
from ddp_lab.grade.core import Exercise, register

CASES = [("cpu", True), ("cuda", True), ("cuda", False)]  # (device type, does it have bf16)
NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _probe(dtype, use_scaler):
    """Relative error of the weight gradient against fp32, for an upstream gradient of 1e-8."""
    import torch
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(16, 1, bias=False), torch.rand(4, 16)
    layer(x).float().sum().mul(1e-8).backward()
    ref = layer.weight.grad.clone()
    layer.zero_grad()
    scale = 2.0 ** 16 if use_scaler else 1.0
    with torch.autocast("cpu", dtype=dtype):
        out = layer(x)
    (out.float().sum() * 1e-8 * scale).backward()
    return float(((layer.weight.grad / scale - ref).norm() / ref.norm()).item())


def on_rank(answer, rank, world):
    import torch
    out = []
    for device, has_bf16 in CASES:
        dtype, use_scaler = answer(device, has_bf16)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"return (torch dtype, bool), e.g. (torch.bfloat16, False); got {dtype!r}")
        name = str(dtype).replace("torch.", "")
        out.append({"device": device, "bf16": has_bf16, "dtype": name, "scaler": bool(use_scaler),
                    "error": _probe(dtype, bool(use_scaler)) if name != "float32" else 0.0,
                    "error_unscaled": _probe(dtype, False) if name != "float32" else 0.0})
    return {"cases": out}


def _finding(c):
    dtype = NAMES.get(c["dtype"], c["dtype"])
    if dtype == "fp32":
        return "fp32 is not mixed precision: autocast to a 16-bit dtype"
    if dtype == "bf16" and not c["bf16"]:
        return "this device has no bf16 (a V100, say): use fp16, with a GradScaler"
    if c["error"] > 0.01:
        return (f"a gradient of 1e-8 came back {c['error']:.0%} wrong in {dtype} without a scaler "
                f"(fp16 flushes it to 0): fp16 needs a GradScaler")
    if dtype == "bf16" and c["scaler"]:
        return (f"bf16 keeps fp32's exponent range (the 1e-8 gradient came back "
                f"{c['error_unscaled']:.1%} off with no scaling at all): drop the GradScaler")
    if dtype == "fp16" and c["bf16"]:
        return "this device has bf16: prefer it, it needs no GradScaler and no scale to manage"
    return None


def judge(per_rank):
    problems = []
    for c in per_rank[0]["cases"]:
        why = _finding(c)
        if why:
            has = "with" if c["bf16"] else "without"
            problems.append(f"{c['device']} {has} bf16: you chose {NAMES.get(c['dtype'], c['dtype'])}, "
                            f"{'with' if c['scaler'] else 'no'} scaler: {why}")
    return problems[:2]


register(Exercise(
    id="04.5", notebook="04_mixed_precision", title="Which dtype, which scaler",
    skills="bf16 where the device has it, without a scaler; fp16 only with GradScaler; fp16 underflow",
    answer="amp_plan(device_type, has_bf16) -> (torch dtype for autocast, use a GradScaler?)",
    nproc=0, on_rank=on_rank, judge=judge))
