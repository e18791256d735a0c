"""Notebook 08, across a real link: what nb08_link measured, and what the scaling model predicts.

    from ddp_lab.lessons.profiling import link
    rows = link.table(run)        # one row per (rate, variant): measured and predicted seconds
    link.scaling(run)             # weak and strong speedups of 2 nodes at each rate

The model is model.py's, fed with this launch's own inputs: each rank's compute (a step without
DDP on both ranks at once, timed beside each variant's steps, so under the same load), the latency alpha of a 4-byte all-reduce, and the link's bytes per
second: the shaped rate as given to tc (nominal), or, unshaped, the gradients' all-reduce as timed.
Per micro-batch of B samples on N = 2 ranks (ring: 2 alpha + S beta):

    DDP, small buckets    compute + what of DDP's bucket all-reduces backward cannot hide
    bf16 hook             the same with half the bytes (the cast itself is not counted)
    PowerSGD              compute + its all-reduces after backward, as counted (its matmuls are not)
    no_sync x4            (4 forward-backward + optimizer + one exposed all-reduce) / 4
    local SGD x4          compute + one all-reduce of the parameters / 4
"""
from __future__ import annotations

from ddp_lab.engine import netcluster
from ddp_lab.experiments import nb08_link as exp
from ddp_lab.lessons import buckets, costmodel, models
from ddp_lab.lessons.profiling import model as pm

N = 2
TOLERANCE = 0.25          # the model's step within 25 % of the measured one


def _one(run, **match) -> dict:
    found = run.select(rank=0, **match)
    if len(found) != 1:
        raise ValueError(f"expected one record {match} from rank 0 of nb08_link, found {len(found)}")
    return found[0]


def tensor_bytes() -> list:
    return [4 * p.numel() for p in exp.make_model().parameters()]


def bucket_sizes(cap_mb=None) -> list:
    """DDP's rebuilt buckets (bytes, launch order): 1 MiB first, then 25 MiB; an explicit cap for all."""
    sizes = tensor_bytes()
    caps = (25 * buckets.MB, buckets.MB) if cap_mb is None else (cap_mb * buckets.MB, None)
    return [sum(sizes[i] for i in b) for b in buckets.assign(sizes, *caps)]


def inputs(run, rate, variant="DDP") -> dict:
    """The model's inputs for `variant` at `rate`: compute parts (the step without DDP timed beside
    the variant's steps), alpha, beta (s/B), and where beta came from."""
    c = _one(run, kind="step", rate=rate, variant=variant)["compute"]
    alpha = _one(run, kind="alpha")["seconds"]
    lk = _one(run, kind="link", rate=rate)
    bits = netcluster.rate_bits(rate)
    if bits:
        beta, source = 8 / bits, "the rate given to tc"
    else:
        beta, source = max(lk["seconds"] - 2 * alpha, 1e-9) / lk["bytes"], "the all-reduce timed unshaped"
    return {"forward": c["forward"], "backward": c["backward"], "optimizer": c["optimizer"],
            "alpha": alpha, "beta": beta, "beta_from": source, "link_s": lk["seconds"], "bytes": lk["bytes"]}


def predict(run, rate, variant, overlap=1.0) -> float:
    """Predicted seconds per micro-batch of `variant` at `rate`; overlap=0 hides nothing under backward."""
    x = inputs(run, rate, variant)
    f, b, o, a, beta = x["forward"], x["backward"], x["optimizer"], x["alpha"], x["beta"]
    ring = lambda nbytes: float(costmodel.ring(nbytes, N, a, beta))
    exposed = lambda sizes: pm.comm_exposed(sizes, N, a, beta, b, overlap=overlap)[1]
    if variant == "DDP":
        return f + b + o + exposed(bucket_sizes())
    if variant == "small buckets":
        return f + b + o + exposed(bucket_sizes(0.25))
    if variant == "bf16 hook":
        return f + b + o + exposed([s / 2 for s in bucket_sizes()])
    if variant == "PowerSGD":
        step = _one(run, kind="step", rate=rate, variant=variant)
        per_step = step["handed"][: len(step["handed"]) // step["steps"]]
        return f + b + o + sum(ring(s) for s in per_step)
    if variant == "no_sync x4":
        return (exp.K * (f + b) + o + exposed(bucket_sizes())) / exp.K
    if variant == "local SGD x4":
        return f + b + o + ring(x["bytes"]) / exp.H
    raise ValueError(f"unknown variant {variant!r}: one of {', '.join(exp.REMEDIES)}")


def table(run) -> list:
    """One row per timed (rate, variant): measured and predicted seconds per micro-batch, their
    ratio, the measured share of the step not spent computing, bytes node 0 sent per micro-batch."""
    rows = []
    for s in run.select(rank=0, kind="step"):
        x = inputs(run, s["rate"], s["variant"])
        compute = x["forward"] + x["backward"] + x["optimizer"]
        p = predict(run, s["rate"], s["variant"])
        rows.append({"rate": s["rate"], "variant": s["variant"], "measured": s["seconds"], "predicted": p,
                     "ratio": s["seconds"] / p, "comm_share": max(0.0, 1 - compute / s["seconds"]),
                     "tx": s["tx"], "forward_in_step": s["forward"], "forward_alone": x["forward"]})
    return rows


def factors(rows, rate) -> dict:
    """variant -> (measured, predicted) speed-up over plain DDP at `rate`."""
    at = {r["variant"]: r for r in rows if r["rate"] == rate}
    base = at["DDP"]
    return {v: (base["measured"] / r["measured"], base["predicted"] / r["predicted"])
            for v, r in at.items() if v != "DDP"}


def scaling(run) -> dict:
    """rate -> weak and strong speed-up of DDP on 2 nodes against one rank alone, measured and
    predicted. Weak: 2 ranks of B samples against one rank's B; strong: the same 2B samples on one."""
    one = {r["batch"]: sum(r[k] for k in ("forward", "backward", "optimizer"))
           for r in run.select(rank=0, kind="alone")}
    out = {}
    for rate in exp.RATES:
        t, p = _one(run, kind="step", rate=rate, variant="DDP")["seconds"], predict(run, rate, "DDP")
        out[rate] = {"weak": (N * one[exp.B] / t, N * one[exp.B] / p),
                     "strong": (one[N * exp.B] / t, one[N * exp.B] / p)}
    return out


def assumptions(run, row) -> list:
    """Which of the model's assumptions a row's miss points at: [] within TOLERANCE, or where no
    input moved (then the step itself varied: a busy machine)."""
    if abs(row["ratio"] - 1) <= TOLERANCE:
        return []
    x = inputs(run, row["rate"], row["variant"])
    found = []
    nominal = float(costmodel.ring(x["bytes"], N, x["alpha"], x["beta"]))
    if x["link_s"] > (1 + TOLERANCE) * nominal:
        found.append(f"the link carried {nominal / x['link_s']:.0%} of its rate")
    if row["forward_in_step"] > (1 + TOLERANCE) * row["forward_alone"]:
        found.append(f"compute is not what was measured without DDP: forward took "
                     f"{row['forward_in_step'] / row['forward_alone']:.1f}x as long inside the step")
    if row["measured"] > predict(run, row["rate"], row["variant"], overlap=0.0):
        found.append("the step outlasts its compute plus its all-reduces with nothing hidden: the two slowed "
                     "each other (the model gives each rank a device and the link a CPU of its own; here "
                     "the ranks and gloo's threads share the cores)")
    if row["variant"] in ("bf16 hook", "PowerSGD") and row["ratio"] > 1:
        found.append("the model counts bytes only, not the hook's own compute (the cast, the low-rank matmuls)")
    if row["ratio"] < 1:
        found.append("more of the all-reduce hid under backward, or compute ran faster, than the inputs say")
    return found


def why(run, row) -> str:
    """assumptions() as one line: '' within TOLERANCE."""
    if abs(row["ratio"] - 1) <= TOLERANCE:
        return ""
    return "; ".join(assumptions(run, row)) or "no input moved: the step itself varied (a busy machine)"

def plot_rates(rows):
    """Bars: DDP's measured step at each rate, split into compute and the rest; dots: the model."""
    import matplotlib.pyplot as plt
    from ddp_lab.lessons.figures import readable
    ddp = [r for r in rows if r["variant"] == "DDP"]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    x = range(len(ddp))
    compute = [r["measured"] * (1 - r["comm_share"]) * 1e3 for r in ddp]
    rest = [r["measured"] * r["comm_share"] * 1e3 for r in ddp]
    ax.bar(x, compute, 0.5, color="C2", label="compute (each rank, no DDP)")
    ax.bar(x, rest, 0.5, bottom=compute, color="C3", label="the rest of the step: communication")
    ax.plot(x, [r["predicted"] * 1e3 for r in ddp], "ko", label="the model's step")
    for i, r in enumerate(ddp):
        ax.text(i, r["measured"] * 1e3, f"{r['comm_share']:.0%}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), [r["rate"] for r in ddp])
    ax.set(yscale="log", ylabel="ms per step (log)", title="DDP on 2 nodes: the slower the link, the larger communication's share")
    ax.legend(fontsize=9); ax.grid(alpha=0.3, axis="y")
    return readable(fig)


def plot_remedies(rows, slow, fast):
    """Speed-up of each remedy over plain DDP, on the slow link and unshaped: bars measured, dots the model."""
    import matplotlib.pyplot as plt
    from ddp_lab.lessons.figures import readable
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    for k, (rate, color) in enumerate(((slow, "C3"), (fast, "C0"))):
        f = factors(rows, rate)
        x = [i + (k - 0.5) * 0.38 for i in range(len(f))]
        ax.bar(x, [m for m, _ in f.values()], 0.36, color=color, label=f"measured, {rate}")
        ax.plot(x, [p for _, p in f.values()], "ko", ms=4, label="the model" if k else None)
        ax.set_xticks(range(len(f)), list(f))
    ax.axhline(1, color="k", lw=0.8)
    ax.set(yscale="log", ylabel="speed-up over DDP (log)", title="Remedies pay on a slow link, not on a fast one")
    ax.legend(fontsize=9); ax.grid(alpha=0.3, axis="y")
    return readable(fig)
