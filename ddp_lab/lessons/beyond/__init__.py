"""Memory arithmetic for data parallelism: DDP, ZeRO-1/2/3 and FSDP (notebook 09).

    from ddp_lab.lessons import beyond
    r = beyond.RECIPES["torch amp+adam"]             # bytes per parameter, by kind
    beyond.per_device(7e9, world=8, strategy="zero3", recipe=r)    # bytes on one device
    print(beyond.table([1e9, 7e9], world=8))          # the static table (handouts, nbval)
    beyond.calculator()                               # the same, with sliders (ipywidgets)

Per parameter, training holds weights, gradients and optimizer state (for Adam, two moments).
Mixed precision has two layouts, and the sharded totals differ between them:

    torch-native  torch.autocast with DDP, ZeroRedundancyOptimizer or FSDP2: fp32 weights and
                  gradients, bf16 only inside each op: 4 + 4 + 8 B/param (what notebook 09 measures)
    DeepSpeed / Megatron-LM mixed precision: bf16 weights and gradients, and an fp32 master copy
                  of the weights beside the fp32 moments, counted as optimizer state as in the
                  ZeRO paper: 2 + 2 + 12 B/param

With P parameters on N devices (Rajbhandari et al. 2020, Fig. 1):

    DDP      (w + g + o) P          every device holds everything
    ZeRO-1   (w + g) P + o P / N    optimizer state sharded
    ZeRO-2   w P + (g + o) P / N    gradients sharded too
    ZeRO-3   (w + g + o) P / N      weights too; FSDP is ZeRO-3 (at rest, between layers)

rank_bytes() makes the same prediction for a real model, tensor by tensor, with the
granularity torch really uses: ZeroRedundancyOptimizer gives each rank whole parameters
(greedily, largest first), FSDP2 gives each rank a dim-0 chunk of every parameter
(torch.chunk: ceil(rows / N) rows, the last ranks fewer).

All of it is persistent state, not peak memory. Activations come on top, per device, untouched by
any of the four (they scale with the local batch and sequence), and so do runtime buffers: FSDP's
all-gathered layers and the next one prefetched, reduce-scatter buffers, the CUDA context, NCCL's
buffers, the caching allocator's fragmentation and autocast's cache of cast weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ddp_lab.lessons import plural

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3/FSDP"}


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter: weights (w), gradients (g), optimizer state incl. master weights (o),
    and the framework that lays memory out this way."""
    name: str
    w: int
    g: int
    o: int
    layout: str = ""

    @property
    def total(self) -> int:
        return self.w + self.g + self.o


TORCH = "PyTorch: DDP, ZeroRedundancyOptimizer, FSDP2"
DEEPSPEED = "DeepSpeed ZeRO, Megatron-LM"
RECIPES = {
    "fp32+sgd": Recipe("fp32, SGD (no momentum)", 4, 4, 0, TORCH),
    "fp32+momentum": Recipe("fp32, SGD + momentum", 4, 4, 4, TORCH),
    "fp32+adam": Recipe("fp32, Adam (m, v)", 4, 4, 8, TORCH),
    "torch amp+adam": Recipe("torch.autocast bf16, Adam: fp32 weights, grads", 4, 4, 8, TORCH),
    "master+adam": Recipe("bf16 weights, grads + fp32 master, Adam", 2, 2, 12, DEEPSPEED),
    "master+adam fp32 grads": Recipe("bf16 weights + fp32 master and grads, Adam", 2, 4, 12, DEEPSPEED),
    "fp16 weights only": Recipe("fp16 weights, inference", 2, 0, 0, "any"),
}
DEFAULT = "torch amp+adam"   # the layout notebook 09 measures, tensor by tensor

# The tool that gives each stage in each layout. torch's ZeRO-2 is ZeRO-2-like: FSDP2 with
# reshard_after_forward=False (FSDP1's SHARD_GRAD_OP) shards gradients and optimizer state like
# ZeRO-2, but shards the weights at rest too (persistent memory below ZeRO-2's) and holds each
# layer's weights whole from its forward to its backward (peak memory above ZeRO-3's).
TOOLS = {TORCH: {"ddp": "DDP", "zero1": "DDP + ZeroRedundancyOptimizer",
                 "zero2": "ZeRO-2-like: FSDP2 fully_shard(reshard_after_forward=False), FSDP1 SHARD_GRAD_OP",
                 "zero3": "FSDP2 fully_shard"},
         DEEPSPEED: {"ddp": "ZeRO stage 0", "zero1": "ZeRO stage 1", "zero2": "ZeRO stage 2",
                     "zero3": "ZeRO stage 3"}}


def per_device(params: float, world: int, strategy: str, recipe: Recipe) -> dict:
    """Persistent bytes of weights, gradients and optimizer state on one device (ideal, evenly
    divisible), before activations and runtime buffers."""
    n = world
    shard = {"ddp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n), "zero3": (n, n, n)}[strategy]
    out = {k: params * getattr(recipe, k) / d for k, d in zip(("w", "g", "o"), shard)}
    out["total"] = sum(out.values())
    return out


def devices_needed(params: float, strategy: str, recipe: Recipe, device_bytes: float,
                   most: int = 4096) -> int | None:
    """Fewest devices whose persistent state fits in device_bytes each (None: not even `most`)."""
    return next((n for n in range(1, most + 1)
                 if per_device(params, n, strategy, recipe)["total"] <= device_bytes), None)


def activation_bytes_transformer(batch, seq, hidden, layers, heads, flash=False) -> float:
    """Bytes of activations a GPT layer stack saves for backward in 16-bit, no recomputation
    (Korthikanti et al. 2022, eq. 2): s*b*h*(34 + 5*a*s/h) per layer. Linear in batch; the
    attention-score term 5*a*s^2*b grows with the square of the sequence (flash=True: a fused
    attention kernel that never stores the scores, so the term is gone)."""
    per_layer = seq * batch * hidden * (34 + (0 if flash else 5 * heads * seq / hidden))
    return per_layer * layers


def mlp_activation_floats(widths, batch: int) -> int:
    """Floats an nn.Sequential(Linear, ReLU, ..., Linear) saves for backward: each Linear its input
    (batch x in). Each ReLU saves its output too, but that is the next Linear's input: the same
    tensor, stored once. widths = (in, hidden..., out)."""
    return batch * sum(widths[:-1])


def saved_activation_floats(model, x) -> int:
    """Floats autograd really saves for backward in model(x), parameters excluded, each storage once."""
    import torch
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(saved.values())


# --- communication per step, in the alpha-beta model of notebook 03 -----------------------------
# (op, payload bytes S) -> (latency rounds, bytes each rank receives), ring algorithms; broadcast
# as a pipelined chain (one round to fill, then S bytes reach every rank). alpha and beta come
# from notebook 03's record (costmodel.load_fit), never from a constant.


def comm_terms(op: str, nbytes: float, world: int) -> tuple[float, float]:
    n = world
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n * nbytes
    if op in ("reduce_scatter", "all_gather"):
        return n - 1, (n - 1) / n * nbytes
    if op == "broadcast":
        return 1, nbytes
    raise ValueError(f"unknown collective {op!r}")


def comm_cost(calls, world: int, alpha: float | None = None, beta: float | None = None) -> dict:
    """Sum over a step's collectives [(op, S), ...]: calls, rounds, bytes received, and seconds
    when alpha and beta are given (None otherwise)."""
    rounds = sum(comm_terms(op, s, world)[0] for op, s in calls)
    moved = sum(comm_terms(op, s, world)[1] for op, s in calls)
    seconds = None if alpha is None or beta is None else rounds * alpha + moved * beta
    return {"calls": len(calls), "rounds": rounds, "bytes": moved, "seconds": seconds}


# --- the same prediction, tensor by tensor, for a real model (fp32, Adam) -------------------------

def zero_partition(numels, world: int) -> list[list[int]]:
    """Indices of the parameters each rank owns: largest first, each to the least-loaded rank
    (the first one on a tie), as ZeroRedundancyOptimizer documents ("optimizing for uniformity")."""
    owned, load = [[] for _ in range(world)], [0] * world
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        r = load.index(min(load))
        owned[r].append(i)
        load[r] += numels[i]
    return owned


def fsdp_rows(rows: int, world: int, rank: int) -> int:
    """Rows of a dim-0 sharded tensor on `rank` (torch.chunk: ceil(rows/world) each, last ones fewer)."""
    chunk = math.ceil(rows / world)
    return max(0, min(chunk, rows - rank * chunk))


def rank_bytes(shapes, strategy: str, world: int, rank: int, moments: int = 2,
               bytes_per: int = 4, step_bytes: int = 4) -> dict:
    """Predicted bytes on `rank` for parameters of these shapes, trained in fp32 with Adam
    (`moments` state tensors the size of the parameter plus one scalar step per parameter).

    strategy: "ddp" (everything everywhere), "zero1" (DDP + ZeroRedundancyOptimizer),
    "fsdp" (FSDP2 fully_shard, at rest after optimizer.step()).
    """
    numels = [math.prod(s) for s in shapes]
    if strategy == "ddp":
        local = numels
        p = g = sum(local)
        o = moments * p
        tensors = len(numels)
    elif strategy == "zero1":
        p = g = sum(numels)
        mine = zero_partition(numels, world)[rank]
        o = moments * sum(numels[i] for i in mine)
        tensors = len(mine)
    elif strategy == "fsdp":
        local = [fsdp_rows(s[0], world, rank) * math.prod(s[1:]) for s in shapes]
        p = g = sum(local)
        o = moments * p
        tensors = len(numels)
    else:
        raise ValueError(f"unknown strategy {strategy!r}: ddp, zero1 or fsdp")
    return {"params": p * bytes_per, "grads": g * bytes_per,
            "optim": o * bytes_per + tensors * step_bytes}


def memory_rows(records, shapes) -> list[dict]:
    """One row per strategy record of a launch: measured bytes beside rank_bytes()' prediction."""
    order = ("ddp", "zero1", "fsdp")
    return [{"world": r["world"], "strategy": r["strategy"], "rank": r["rank"], "measured": r["bytes"],
             "predicted": rank_bytes(shapes, r["strategy"], r["world"], r["rank"])}
            for r in sorted(records, key=lambda r: (r["world"], order.index(r["strategy"]), r["rank"]))]


# --- tables and the calculator ------------------------------------------------------------------

def gb(x: float) -> str:
    return f"{x / 1e9:,.1f}"


def table(param_counts=(1e9, 7e9, 70e9), world: int = 8, recipe: Recipe = RECIPES[DEFAULT],
          device_gb: float = 80.0) -> str:
    """Per-device GB (10^9 bytes) of weights + grads + optimizer state: persistent state only."""
    head = f"{'params':>8} | " + " | ".join(f"{LABELS[s]:>11}" for s in STRATEGIES)
    lines = [f"{recipe.name} ({recipe.layout}), {recipe.w}+{recipe.g}+{recipe.o} B/param, "
             f"{plural(world, 'device')}: GB per device",
             f"(* = fits in {device_gb:g} GB, before activations and runtime buffers)", head, "-" * len(head)]
    for n in param_counts:
        cells = []
        for s in STRATEGIES:
            t = per_device(n, world, s, recipe)["total"]
            cells.append(f"{gb(t) + ('*' if t <= device_gb * 1e9 else ' '):>11}")
        lines.append(f"{n / 1e9:>7g}B | " + " | ".join(cells))
    return "\n".join(lines)


# Model sizes the params slider offers (billions), besides the one the call asks for.
SIZES_B = (0.1, 0.125, 0.35, 0.5, 0.77, 1, 1.3, 1.5, 2.7, 3, 6.7, 7, 8, 13, 30, 34, 65, 70, 175, 405, 1000)


def calculator(params_b: float = 7.0, world: int = 8, device_gb: float = 80.0):
    """Sliders over parameters (billions), devices, recipe and device memory; prints table()'s row
    and the per-kind split live. Every control starts at the call's value exactly (the params slider
    steps through SIZES_B and params_b). Without ipywidgets it prints the static table instead
    (notebooks also print table() beside it, for handouts and viewers without a kernel)."""
    if params_b <= 0 or world < 1 or device_gb <= 0:
        raise ValueError(f"calculator(params_b={params_b}, world={world}, device_gb={device_gb}): "
                         f"give positive parameters (billions), devices and GB per device")
    try:
        import ipywidgets as W
    except ImportError:
        print(table(world=world))
        return None
    from ddp_lab.lessons.widgets import grid_min, runnable

    def show(params_b, world, recipe, device_gb):
        r = RECIPES[recipe]
        print(table([params_b * 1e9], world=world, recipe=r, device_gb=device_gb))
        for s in STRATEGIES:
            d = per_device(params_b * 1e9, world, s, r)
            print(f"  {LABELS[s]:<12} w {gb(d['w']):>7}  g {gb(d['g']):>7}  o {gb(d['o']):>7} GB"
                  f"  ({TOOLS.get(r.layout, {}).get(s, '-')})")

    sizes = sorted({*SIZES_B, params_b})
    form = W.interactive(show, params_b=W.SelectionSlider(options=[(f"{b:g}", b) for b in sizes], value=params_b,
                                                          description="params (B)"),
                         world=W.IntSlider(value=world, min=1, max=max(1024, world), description="devices"),
                         recipe=W.Dropdown(options=list(RECIPES), value=DEFAULT),
                         device_gb=W.FloatSlider(value=device_gb, min=grid_min(device_gb, 8, 8),
                                                 max=max(192, device_gb), step=8, description="GB/device"))
    return runnable(W, [form], "Memory calculator")


# --- the model and data every strategy in notebook 09 trains ------------------------------------

WIDTHS = (32, 256, 256, 10)   # 10 classes: 10 rows do not split evenly over 4 ranks (3, 3, 3, 1)
GLOBAL_BATCH, STEPS, LR = 32, 10, 3e-3


def build_model():
    """The same MLP, with the same initial weights, in every process (seed 0)."""
    import torch
    from torch import nn
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(WIDTHS) - 2 else [])
    return nn.Sequential(*layers)


def global_batch(step: int):
    """Step `step`'s global batch; rank r of N trains on rows [r*B/N, (r+1)*B/N)."""
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, WIDTHS[0], generator=g)
    teacher = torch.randn(WIDTHS[0], WIDTHS[-1], generator=torch.Generator().manual_seed(0))
    return x, (x @ teacher).argmax(1)   # labels a fixed linear teacher gives: something to learn


def reference_losses(steps: int = STEPS) -> list[float]:
    """One process, the whole global batch, plain Adam: what every strategy must reproduce."""
    import torch
    import torch.nn.functional as F
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@dataclass
class Group:
    """Some ranks of a launch working as a job of their own: notebook 09 runs a 2-rank job inside
    a 4-process launch (one launch costs less than two on a small machine). rank and world_size
    are within the group; records say both, so they read like the records of a 2-rank launch."""
    ctx: object                # ddp_lab.engine.runtime.Context of the launch
    pg: object = None          # the group's ProcessGroup; None: every rank of the launch
    rank: int = 0
    world_size: int = 1

    @classmethod
    def of(cls, ctx, pg=None) -> "Group":
        import torch.distributed as dist
        return cls(ctx, pg, dist.get_rank(pg), dist.get_world_size(pg))

    @property
    def device(self):
        return self.ctx.device

    def record(self, **fields) -> None:
        self.ctx.record(**fields, rank=self.rank, world=self.world_size)

    def mesh(self):
        """A 1-D CPU DeviceMesh over the group (fully_shard alone would pick CUDA where present)."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        if self.pg is None:
            return init_device_mesh("cpu", (self.world_size,))
        return DeviceMesh.from_group(self.pg, "cpu")
