"""Figures for notebook 08, drawn from parsed traces (ddp_lab.lessons.profiling) and measured times."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ddp_lab.lessons import plural, profiling
from ddp_lab.lessons.figures import readable

COLORS = {"data": "#4C72B0", "forward": "#55A868", "backward": "#8FBC8F", "backward span": "#E5F2E5",
          "optimizer": "#8172B3", "all-reduce": "#C44E52", "exposed comm": "#C44E52", "other": "#BBBBBB"}


def timeline(run: dict, first: int = 0, count: int = 2, title: str = "", ax=None):
    """One lane per rank: the main thread's phases on top, the all-reduces (gloo's threads)
    below, so a bucket's all-reduce under backward's bars is overlap. run: {rank: [Step]}."""
    ranks = sorted(run)
    t0 = min(run[r][first].start for r in ranks)
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.9 + 0.85 * len(ranks)))
    for i, r in enumerate(ranks):
        y = (len(ranks) - 1 - i) * 1.0
        for s in run[r][first:first + count]:
            ms = lambda a, b: ((a - t0) / 1e3, (b - a) / 1e3)
            for name, (a, b) in s.phases.items():
                color = COLORS["backward span"] if name == "backward" else COLORS[name]
                ax.broken_barh([ms(a, b)], (y + 0.45, 0.4), color=color, ec="none")
            ax.broken_barh([ms(a, b) for a, b in s.backward_ops], (y + 0.45, 0.4), color=COLORS["backward"])
            ax.broken_barh([ms(a, b) for a, b in s.comm], (y + 0.05, 0.35), color=COLORS["all-reduce"],
                           ec="white", lw=0.5)
            ax.axvline((s.start - t0) / 1e3, color="gray", lw=0.5, ls=":")
    ax.set_yticks([(len(ranks) - 1 - i) + 0.45 for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.set_xlabel("ms since the first step began (dotted: each rank's step starts)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in
               ("data", "forward", "backward", "backward span", "optimizer", "all-reduce")]
    ax.legend(handles, ["data", "forward", "backward compute", "backward (waiting, engine)", "optimizer",
                        "all-reduce (gloo thread)"], fontsize=7, ncol=6, loc="upper center",
              bbox_to_anchor=(0.5, -0.28 if len(ranks) < 3 else -0.18))
    ax.set_title(title, fontsize=11)
    readable(ax.figure).tight_layout()
    return ax.figure


def budget_bars(rows):
    """rows: dicts with label, parts (seconds, profiling.PARTS), step_s (traced), samples_s (unprofiled)."""
    fig, ax = plt.subplots(figsize=(11, 3.8))
    x = np.arange(len(rows))
    for i, r in enumerate(rows):
        total = sum(r["parts"][k] for k in profiling.PARTS)
        bottom = 0.0
        for k in profiling.PARTS:
            share = r["parts"][k] / total * 100
            ax.bar(i, share, bottom=bottom, color=COLORS[k], label=k if i == 0 else None, width=0.6)
            bottom += share
        ax.text(i, 102, f"{r['step_s'] * 1e3:.1f} ms\n{r['samples_s']:,.0f}/s", ha="center", fontsize=7.5)
    ax.set_xticks(x, [r["label"] for r in rows], fontsize=8)
    ax.set_ylim(0, 118)
    ax.set_ylabel("% of the traced step")
    ax.set_title("Step budget per configuration (above: traced step, and samples/s measured without "
                 "the profiler)", fontsize=10)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    readable(fig).tight_layout()
    return fig


def scaling(ns, measured: dict, predicted: dict, predicted_cores: dict, cores: int):
    """Step time against N per model: measured, the model with a device per rank, and the
    model with the ranks sharing `cores` cores."""
    fig, axes = plt.subplots(1, len(measured), figsize=(5.5 * len(measured), 3.6))
    for ax, name in zip(np.atleast_1d(axes), measured):
        ax.plot(ns, np.array(measured[name]) * 1e3, "ko-", label="measured (median step)")
        ax.plot(ns, np.array(predicted[name]) * 1e3, "s--", color="#4C72B0", label="model: a device per rank")
        ax.plot(ns, np.array(predicted_cores[name]) * 1e3, "^:", color="#DD8452",
                label=f"model: ranks share {plural(cores, 'core')}")
        ax.set_xticks(ns)
        ax.set_xlabel("ranks N (same global batch)")
        ax.set_ylabel("ms per step")
        ax.set_title(f"{name} model", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    readable(fig).tight_layout()
    return fig


def cluster_speedups(rows_by_case: dict, n: int):
    """rows_by_case: case label -> profiling_model.cluster_table rows. Speedup on n GPUs per link."""
    fig, ax = plt.subplots(figsize=(10, 3.8))
    links = [r["link"] for r in next(iter(rows_by_case.values()))]
    width = 0.8 / len(rows_by_case)
    for k, (case, rows) in enumerate(rows_by_case.items()):
        ax.barh(np.arange(len(links)) + k * width, [r["speedup"] for r in rows], height=width, label=case)
    ax.axvline(n, color="black", ls="--", lw=1, label=f"ideal {n}x")
    ax.set_yticks(np.arange(len(links)) + width * (len(rows_by_case) - 1) / 2, links, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"predicted speedup on {plural(n, 'GPU')} (nominal bandwidths, assumed latencies: not measured here)")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    readable(fig).tight_layout()
    return fig
