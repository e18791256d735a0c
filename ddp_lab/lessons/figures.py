"""Figures for notebooks 01 (DataParallel vs DDP), 02 (samplers and metrics), 03 and 06.

Every function draws from numbers it is given (measured or counted) and returns
the matplotlib Figure, so a notebook cell shows it and a script can save it.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from ddp_lab.lessons import plural

# Smallest font sizes (points) that read at 100 % zoom in JupyterLab: tick labels, axis labels and
# titles, any other text (legends, bar annotations).
TICK_PT, LABEL_PT, TEXT_PT = 10, 11, 9


def readable(fig):
    """Raise every font of `fig` below those floors to the floor; larger fonts stay. Returns fig."""
    from matplotlib.text import Text
    ticks, labels = set(), set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            ticks.update(axis.get_ticklabels(which="both"))
            labels.add(axis.label)
            if min((t.get_fontsize() for t in axis.get_ticklabels()), default=TICK_PT) < TICK_PT:
                axis.set_tick_params(which="both", labelsize=TICK_PT)  # ticks drawn later too
        labels.update((ax.title, ax._left_title, ax._right_title))
    for t in fig.findobj(Text):
        floor = TICK_PT if t in ticks else LABEL_PT if t in labels else TEXT_PT
        if t.get_text() and t.get_fontsize() < floor:
            t.set_fontsize(floor)
    return fig


RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _box(ax, xy, text, color, w=1.6, h=0.8):
    x, y = xy
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05",
                                fc=color, ec="black", alpha=0.9))
    ax.text(x, y, text, ha="center", va="center", fontsize=9)


def _arrow(ax, a, b, label="", color="black", rad=0.0, offset=(0, 0.12)):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, color=color,
                                 connectionstyle=f"arc3,rad={rad}", lw=1.4))
    if label:
        mx, my = (a[0] + b[0]) / 2 + offset[0], (a[1] + b[1]) / 2 + offset[1]
        ax.text(mx, my, label, ha="center", fontsize=7.5, color=color)


def dataflow(n: int = 4):
    """DataParallel (one process, device 0 in the middle of everything) next to DDP (a ring)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax in (a, b):
        ax.set_xlim(-1, 9)
        ax.set_ylim(-0.6, 5.2)
        ax.axis("off")
    a.set_title("nn.DataParallel: one process, N threads, every step", fontsize=10)
    a.add_patch(FancyBboxPatch((-0.8, -0.5), 9.6, 5.5, boxstyle="round,pad=0.02", fc="none",
                               ec="gray", ls="--"))
    a.text(8.6, 4.75, "one Python process (one GIL)", ha="right", fontsize=8, color="gray")
    dev0 = (1.3, 2.2)
    _box(a, dev0, "device 0, thread 0\nwhole batch, model,\nloss, optimizer", "#F4D03F", w=2.5, h=1.5)
    ys = np.linspace(4.0, 0.4, n - 1)
    steps = [("1 scatter inputs", "#1f77b4"), ("2 broadcast weights", "#2ca02c"),
             ("3 gather outputs", "#9467bd"), ("4 reduce gradients", "#d62728")]
    for k, y in enumerate(ys, start=1):
        _box(a, (7.2, y), f"device {k}\nthread {k}", "#D6EAF8")
        for j, (_, color) in enumerate(steps):
            dy = (j - 1.5) * 0.14
            s, e = ((2.55, dev0[1] + dy), (6.4, y + dy)) if j < 2 else ((6.4, y + dy), (2.55, dev0[1] + dy))
            _arrow(a, s, e, "", color)
    # the four phases as a legend: labels on the arrows would be too small to read
    a.legend(handles=[Line2D([], [], color=c, lw=2, label=t) for t, c in steps], loc="upper left",
             fontsize=9, frameon=False, bbox_to_anchor=(0.03, 0.96))
    a.text(1.3, 0.55, "loss and backward start here;\nreplicas rebuilt and weights\nbroadcast every step;\n"
           "gradients reduced after backward", ha="center", fontsize=8.5)
    b.set_title("DistributedDataParallel: one process per device", fontsize=10)
    angles = np.linspace(np.pi / 2, np.pi / 2 - 2 * np.pi, n, endpoint=False)
    pts = [(4 + 3.2 * np.cos(t), 2.3 + 1.9 * np.sin(t)) for t in angles]
    for r, p in enumerate(pts):
        _box(b, p, f"process {r} / device {r}\nfull model, own\nbatch shard, optimizer",
             RANK_COLORS[r % 8], w=2.4, h=1.0)
    for r in range(n):
        s, e = np.array(pts[r]), np.array(pts[(r + 1) % n])
        d = (e - s) / np.linalg.norm(e - s)
        _arrow(b, tuple(s + d * 1.1), tuple(e - d * 1.1), "", "#d62728", rad=0.15)
    b.text(4, 2.3, "gradients all-reduced\nin buckets during backward\n(ring: 2(N-1)/N x size\nper device)",
           ha="center", va="center", fontsize=8, color="#d62728")
    fig.tight_layout()
    return fig


def link_bytes(ns, series: dict, param_bytes: float):
    """series: label -> bytes in + out of the busiest device per step, for each N (counted)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = ["o-", "s--", "^-", "v:"]
    for (label, values), style in zip(series.items(), styles):
        ax.plot(ns, np.array(values) / param_bytes, style, label=label)
    ax.set_xlabel("devices N")
    ax.set_ylabel("bytes in + out of the busiest device / P")
    ax.set_title(f"Weights and gradients per step (P = {param_bytes / 1e6:.2f} MB of parameters)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def replicate_cost(ns, replicate_s: dict, forward_s: dict):
    """replicate_s / forward_s: model label -> seconds for each N (measured)."""
    fig, ax = plt.subplots(figsize=(9.5, 3.8))
    for k, (label, values) in enumerate(replicate_s.items()):
        color = RANK_COLORS[k % len(RANK_COLORS)]
        ax.plot(ns, np.array(values) * 1e3, "o-", color=color, label=f"{label}: replicate()")
        ax.plot(ns, np.array(forward_s[label]) * 1e3, "s:", color=color, label=f"{label}: one replica's forward")
    ax.set_xlabel("devices N")
    ax.set_ylabel("ms (best of 5)")
    ax.set_yscale("log")
    ax.set_title("Building the replicas, every step, in Python", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def step_time_bars(rows):
    """rows: dicts with model, one_core_s, all_cores_s, compute_s, step_s (DDP)."""
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.8))
    for ax, r in zip(np.atleast_1d(axes), rows):
        labels = ["1 process\n1 core", "1 process\nall cores", "DDP\n2 ranks"]
        ax.bar(labels[:2], [r["one_core_s"] * 1e3, r["all_cores_s"] * 1e3], color="#8C8C8C")
        ax.bar(labels[2], r["compute_s"] * 1e3, color="#55A868", label="compute (no_sync)")
        ax.bar(labels[2], max(r["step_s"] - r["compute_s"], 0) * 1e3, bottom=r["compute_s"] * 1e3,
               color="#d62728", label="gradient sync not hidden")
        ax.set_title(f"{r['model']}: {r['params'] / 1e6:.2f} M params, global batch {r['global_batch']}",
                     fontsize=9)
        ax.set_ylabel("ms per step (same global batch)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def bn_gaps(gaps_by_mode: dict):
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for mode, gaps in gaps_by_mode.items():
        ax.plot(range(1, len(gaps) + 1), gaps, marker=".", label=mode)
    ax.set_xlabel("training step")
    ax.set_ylabel("max |rank r - rank 0|")
    ax.set_title("First BatchNorm's running mean as each forward starts, across ranks")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def index_grid(panels: dict, n: int):
    """panels: title -> per-rank index lists. One row per panel, one column per sample;
    the colour says which rank reads it, a cross marks a sample read twice, white none."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(min(14, 0.5 * n + 2), 1.1 * len(panels) + 0.6))
    world = max(len(s) for s in panels.values())
    cmap = ListedColormap(["white"] + RANK_COLORS[:world])
    for ax, (title, shards) in zip(np.atleast_1d(axes), panels.items()):
        owner, reads = np.zeros(n), np.zeros(n)
        for r, shard in enumerate(shards):
            for i in shard:
                owner[i] = r + 1
                reads[i] += 1
        ax.imshow(owner[None, :], cmap=cmap, vmin=0, vmax=world, aspect="auto")
        for i in np.where(reads > 1)[0]:
            ax.text(i, 0, "x", ha="center", va="center", fontsize=12, weight="bold")
        ax.set_yticks([])
        ax.set_xticks(range(n))
        ax.tick_params(labelsize=7)
        ax.set_title(title, fontsize=9, loc="left")
    handles = [plt.Rectangle((0, 0), 1, 1, color=RANK_COLORS[r]) for r in range(world)]
    fig.legend(handles, [f"rank {r}" for r in range(world)], loc="upper right", ncol=world, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def epoch_orders(without: list, with_: list):
    """Rank 0's index order per epoch, without and with set_epoch."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), sharey=True)
    for ax, orders, title in zip(axes, (without, with_), ("no set_epoch", "sampler.set_epoch(epoch)")):
        for e, order in enumerate(orders):
            ax.plot(order, marker="o", ms=3, lw=1, label=f"epoch {e}", alpha=0.8)
        ax.set_title(f"rank 0's order, {title}", fontsize=9)
        ax.set_xlabel("position in the epoch")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("sample index")
    fig.tight_layout()
    return fig


def padded_accuracy(worlds, padded, exact):
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(worlds, np.array(padded) * 100, "o-", label="DistributedSampler (padded duplicates)")
    ax.axhline(exact * 100, color="black", ls="--", label="every sample once (= one process)")
    ax.set_xlabel("world size")
    ax.set_ylabel("validation accuracy (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def straggler_idle(rows) -> float:
    """Share of rank time spent idle waiting for the slowest rank's compute, step by step."""
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r["compute_s"])
    span = sum(max(c) * len(c) for c in by_step.values())
    return sum(max(c) * len(c) - sum(c) for c in by_step.values()) / span if span else 0.0


def straggler(records, samplers):
    """Per-step compute seconds per rank, one panel per sampler."""
    fig, axes = plt.subplots(1, len(samplers), figsize=(6 * len(samplers), 3.6), sharey=True)
    for ax, name in zip(np.atleast_1d(axes), samplers):
        rows = [r for r in records if r["sampler"] == name]
        for rank in sorted({r["rank"] for r in rows}):
            mine = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["step"])
            ax.plot([r["step"] for r in mine], [r["compute_s"] * 1e3 for r in mine], marker=".",
                    color=RANK_COLORS[rank], label=f"rank {rank} compute")
        ax.set_title(f"{name}: {100 * straggler_idle(rows):.0f}% of rank time idle, waiting for the slowest",
                     fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    np.atleast_1d(axes)[0].set_ylabel("ms of compute per step")
    fig.tight_layout()
    return fig


def loader_bars(results, serial_s: float):
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = [r["config"] for r in results]
    ax.barh(names, [r["total_s"] for r in results], color="#4C72B0")
    ax.axvline(serial_s, color="black", ls="--", label="load + step one after the other")
    ax.invert_yaxis()
    ax.set_xlabel("seconds for 2 epochs (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def bucket_sweep_and_timeline(caps, n_buckets, rows):
    """Notebook 03: ms per step against bucket_cap_mb (caps: records with cap and median_s), and
    when each all-reduce runs in one step (rows: (label, start_s, width_s, color))."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    ax1.plot([r["cap"] for r in caps], [r["median_s"] * 1e3 for r in caps], "o-")
    for r, nb in zip(caps, n_buckets):
        ax1.annotate(plural(nb, "bucket"), (r["cap"], r["median_s"] * 1e3), textcoords="offset points",
                     xytext=(4, 6), fontsize=8)
    ax1.set(xscale="log", xlabel="bucket_cap_mb", ylabel="ms per step (median)", title="bucket_cap_mb sweep")
    ax1.grid(alpha=0.3)
    for i, (label, start, width, color) in enumerate(rows):
        ax2.barh(i, width * 1e3, left=start * 1e3, color=color)
    ax2.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax2.invert_yaxis()
    ax2.set(xlabel="ms since the step began (rank 0; forward runs before backward)",
            title="When each all-reduce runs")
    ax2.set_xlim(left=0)
    ax2.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def save_interval(grid, overhead, first_order, simulated, young, tb_per_day, title):
    """Notebook 06: time lost (%) against the save interval, Young's optimum, and TB written per day.
    overhead, first_order, tb_per_day: functions of N; simulated: [(N, fraction)]."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.plot(grid, [100 * overhead(n) for n in grid], label="model")
    ax.plot(grid, [100 * first_order(n) for n in grid], ls=":", color="tab:blue", label="first order")
    ax.plot([n for n, _ in simulated], [100 * s for _, s in simulated], "o", color="k", ms=4,
            label="simulated failures")
    ax.axvline(young, color="tab:green", ls="--", label=f"Young: every {plural(round(young), 'step')}")
    ax.set(xscale="log", ylim=(0, 40), xlabel="save every N steps", ylabel="time not making progress (%)",
           title=title)
    ax2 = ax.twinx()
    ax2.plot(grid, [tb_per_day(n) for n in grid], color="tab:orange", label="TB written per day")
    ax2.set_yscale("log")
    ax2.set_ylabel("TB written per day", color="tab:orange")
    ax.legend(loc="upper center", fontsize=8)
    fig.tight_layout()
    return fig
