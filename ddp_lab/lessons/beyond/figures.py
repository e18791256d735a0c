"""Figures of notebooks 09 and 09b: memory measured against predicted, losses, 3D, pipeline schedules.

    from ddp_lab.lessons.beyond import figures as bf
    bf.memory_bars(rows)      # rows: dicts with world, strategy, rank, measured {...}, predicted {...}
    bf.losses(curves, ref)    # {label: [loss per step]}, the one-process reference
    bf.three_d(dp=2, pp=2, tp=2)
    bf.split_bytes(sweep, ddp_bytes)   # bytes per step of a pipeline, tensor-parallel and DDP split
    bf.pipeline(grid, util)   # a GPipe schedule grid, busy fraction against micro-batches
    bf.schedules(grids)       # {name: grid}: schedules one above the other, with what each stage holds
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

from ddp_lab.lessons import plural

KINDS = ("params", "grads", "optim")
COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optim": "#55a868"}
NAMES = {"ddp": "DDP", "zero1": "DDP+ZeRO-1", "fsdp": "FSDP2"}
SHORT = {"ddp": "DDP", "zero1": "ZeRO-1", "fsdp": "FSDP2"}


def memory_bars(rows):
    """Stacked bars of measured KB per rank (parameters, gradients, optimizer state); a black
    outline marks the calculator's prediction of the total. One panel per world size."""
    worlds = sorted({r["world"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 3.6), sharey=True, squeeze=False)
    for ax, world in zip(axes[0], worlds):
        mine = [r for r in rows if r["world"] == world]
        labels = []
        for i, r in enumerate(mine):
            bottom = 0.0
            for k in KINDS:
                v = r["measured"][k] / 1e3
                ax.bar(i, v, bottom=bottom, color=COLORS[k], label=k if i == 0 else None)
                bottom += v
            ax.bar(i, sum(r["predicted"].values()) / 1e3, fill=False, edgecolor="black", lw=1.2,
                   label="predicted total" if i == 0 else None)
            labels.append(f"{SHORT[r['strategy']]}\nr{r['rank']}")
        ax.set_xticks(range(len(mine)), labels, fontsize=7)
        ax.set_title(f"{world} ranks: bytes each rank holds after a step")
        ax.set_ylabel("KB")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def losses(curves: dict, reference):
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(reference, "k-", lw=4, alpha=0.25, label="one process, whole batch")
    for (label, ys), marker in zip(curves.items(), "ox+^sv"):
        ax.plot(ys, marker=marker, ls="none", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("global mean loss")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def three_d(dp: int = 2, pp: int = 2, tp: int = 2):
    """dp replicas (panels) x pp stages (columns) x tp shards (rows): rank numbers as Megatron-LM
    orders them (tensor-parallel ranks adjacent, so they share a machine's fast links)."""
    fig, axes = plt.subplots(1, dp, figsize=(3.6 * dp, 2.8), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for d, ax in enumerate(axes[0]):
        ax.set_xlim(-0.2, pp * 1.5)
        ax.set_ylim(-0.6, tp * 1.0 + 0.4)
        ax.axis("off")
        ax.set_title(f"data-parallel replica {d}", fontsize=9)
        for s in range(pp):
            for t in range(tp):
                rank = d * pp * tp + s * tp + t
                x, y = s * 1.5, (tp - 1 - t) * 1.0
                ax.add_patch(Rectangle((x, y), 1.0, 0.8, color=cmap(s), alpha=0.35 + 0.3 * t / max(tp - 1, 1)))
                ax.text(x + 0.5, y + 0.4, f"rank {rank}\nstage {s}, shard {t}",
                        ha="center", va="center", fontsize=7)
            if s < pp - 1:
                ax.add_patch(FancyArrowPatch((s * 1.5 + 1.0, tp * 0.5 - 0.1), (s * 1.5 + 1.5, tp * 0.5 - 0.1),
                                             arrowstyle="->", mutation_scale=12))
        ax.text(0, -0.45, "columns: pipeline stages (send/recv)\nrows: tensor shards (all-reduce per layer)",
                fontsize=7, va="center")
    fig.suptitle(f"3D parallelism, {dp * pp * tp} ranks: same-position ranks of the replicas "
                 f"all-reduce gradients (data parallel)", fontsize=9)
    fig.tight_layout()
    return fig


def split_bytes(sweep: dict, ddp_bytes: float, world: int = 2):
    """Bytes per step against samples per step: sweep {batch: (pipeline bytes, tensor-parallel
    bytes per rank)}, counted in the notebook; DDP's all-reduce per rank is flat."""
    fig, ax = plt.subplots(figsize=(5.2, 3.2))
    b = sorted(sweep)
    ax.loglog(b, [sweep[x][0] / 2**20 for x in b], "o-", label="pipeline: activations + their gradients")
    ax.loglog(b, [sweep[x][1] / 2**20 for x in b], "s-", label="tensor parallel: all-reduces, per rank")
    ax.loglog(b, [ddp_bytes / 2**20] * len(b), "k--", label="DDP: gradient all-reduce, per rank")
    ax.set_xticks(b, [str(x) for x in b])
    ax.minorticks_off()
    ax.set_xlabel("samples per step")
    ax.set_ylabel("MiB per step")
    ax.set_title(f"What crosses between {plural(world, 'device')} per step", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def pipeline(grid, util: dict):
    """Left: a GPipe schedule (stages x time slots, F/B + micro-batch, blank = idle).
    Right: busy fraction against micro-batches, simulated (points) and m / (m + k - 1) (line)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 2.9), gridspec_kw={"width_ratios": [1.5, 1]})
    k, slots = len(grid), len(grid[0])
    for s, row in enumerate(grid):
        for t, cell in enumerate(row):
            if cell is not None:
                a.add_patch(Rectangle((t, k - 1 - s), 0.95, 0.9, color="#4c72b0" if cell[0] == "F" else "#dd8452"))
                a.text(t + 0.47, k - 1 - s + 0.45, cell, ha="center", va="center", fontsize=7, color="white")
    a.set_xlim(0, slots)
    a.set_ylim(0, k)
    a.set_yticks([k - 1 - s + 0.45 for s in range(k)], [f"stage {s}" for s in range(k)])
    a.set_xlabel("time slot")
    a.set_title(f"GPipe, {k} stages: forwards (F), then backwards (B); blank = idle", fontsize=9)
    for kk, curve in util.items():
        m = sorted(curve)
        b.plot(m, [float(curve[x]) for x in m], "o", ms=3, label=f"{kk} stages, simulated")
        b.plot(m, [x / (x + kk - 1) for x in m], "-", lw=0.8, color=b.lines[-1].get_color())
    b.set_xscale("log", base=2)
    b.set_ylim(0, 1.02)
    b.set_xlabel("micro-batches per step")
    b.set_ylabel("busy fraction")
    b.set_title("lines: m / (m + stages - 1)", fontsize=9)
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def schedules(grids: dict):
    """Pipeline schedules one above the other (stages x time slots, F/B + micro-batch, blank = idle),
    with the micro-batches each stage holds (forward done, backward not yet) at the right."""
    fig, axes = plt.subplots(len(grids), 1, figsize=(10, 1.25 * sum(len(g) for g in grids.values()) / 2 + 0.6),
                             squeeze=False)
    for a, (name, grid) in zip(axes[:, 0], grids.items()):
        k, slots = len(grid), len(grid[0])
        for s, row in enumerate(grid):
            held = peak = 0
            for t, cell in enumerate(row):
                if cell is not None:
                    a.add_patch(Rectangle((t, k - 1 - s), 0.95, 0.9, color="#4c72b0" if cell[0] == "F" else "#dd8452"))
                    a.text(t + 0.47, k - 1 - s + 0.45, cell, ha="center", va="center", fontsize=7, color="white")
                    held += 1 if cell[0] == "F" else -1
                    peak = max(peak, held)
            a.text(slots + 0.3, k - 1 - s + 0.45, f"holds {peak}", va="center", fontsize=7)
        a.set_xlim(0, slots + 2.5)
        a.set_ylim(0, k)
        a.set_yticks([k - 1 - s + 0.45 for s in range(k)], [f"stage {s}" for s in range(k)])
        a.set_title(f"{name}: blank = idle; 'holds' = most micro-batches' activations kept at once", fontsize=9)
    axes[-1, 0].set_xlabel("time slot")
    fig.tight_layout()
    return fig
