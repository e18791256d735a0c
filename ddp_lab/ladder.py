"""The script ladder: scripts/minimal_ddp.py grown into scripts/train_ddp.py in runnable rungs.

Each rung is a whole program (copy any of them) and a small diff of the one before; notebook 06b
renders the diffs and tests/test_ladder.py keeps the ladder a ladder:

- no rung changes more than MAX_CHANGED lines of the one before;
- a rung adds or changes exactly the functions it declares in `changes` (so a fix made in
  train_ddp.py alone, and not in the rungs below it, fails the test);
- every rung runs on its own under torchrun.
"""
from __future__ import annotations

import ast
import difflib
import html
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
MAX_CHANGED = 160  # changed lines (added + removed, blank lines not counted) between two rungs


@dataclass(frozen=True)
class Rung:
    file: str
    title: str
    adds: str        # two lines: what the rung adds, and why
    changes: tuple   # the functions and classes it adds or changes


RUNGS = [
    Rung("minimal_ddp.py", "the smallest correct DDP program",
         "init_process_group (bound to its GPU by device_id), a DistributedSampler with set_epoch, DDP.\n"
         "Runs as one process or under torchrun, on CPUs (gloo) or one GPU per process (NCCL).",
         ("parse_args", "free_port", "setup", "build_data", "build_model", "train", "main")),
    Rung("ddp2_metrics.py", "metrics done right",
         "The digits instead of rung 1's synthetic set; global loss and samples/s, exact validation.\n"
         "Rank 0's own numbers describe 1/N of the data; the padded sampler counts samples twice.",
         ("parse_args", "build_data", "load_digits_split", "Metrics", "evaluation_loader", "evaluate",
          "Window", "say", "train")),
    Rung("ddp3_checkpoint.py", "checkpoint and resume",
         "Atomic saves by rank 0, read by rank 0 and broadcast, resumed at the exact batch.\n"
         "A crash then costs minutes, not the run, and the resumed run equals an uninterrupted one.",
         ("parse_args", "setup", "ResumableSampler", "atomic_save", "resume_state", "rng_state",
          "set_rng_state", "resume", "save_checkpoint", "steps_left", "train")),
    Rung("ddp4_amp_accum.py", "a bigger batch, cheaply",
         "Mixed precision, accumulation with no_sync, LR scaling and warmup, clipping, a NaN guard.\n"
         "K micro-batches cost one all-reduce; a non-finite gradient norm skips the step on every rank.",
         ("parse_args", "build_optimizer", "resume", "evaluate", "optimizer_step", "autocast", "is_sync_step",
          "group_size",
          "steps_left", "train")),
    Rung("ddp5_errors.py", "clear errors",
         "Bad flags, unusable devices, more ranks than samples: one message, exit code 2, every rank.\n"
         "Without it, each rank prints its own traceback, or one waits forever; a too-big batch is capped.",
         ("parse_args", "UsageError", "validate", "agree", "pick_device", "setup", "load_digits_split",
          "fit_batch", "check_start", "train", "main")),
    Rung("ddp6_checkpoint_errors.py", "checkpoints you can trust",
         "An unwritable folder, a full disk, an unreadable or mismatched checkpoint: one clear message.\n"
         "A failed save never damages the last good checkpoint, and no run resumes into the wrong model.",
         ("os_error_in", "describe_write_error", "atomic_save", "check_writable", "run_spec",
          "read_checkpoint", "resume_state", "resume", "save_checkpoint", "check_start", "train")),
    Rung("ddp7_data_models.py", "your data and your model",
         "CIFAR-10, ImageFolder, synthetic data; a CNN, ResNet-18, dropout, BatchNorm, SyncBatchNorm.\n"
         "Own random streams per rank after identical weights; rank 0's BatchNorm stats for evaluation.",
         ("parse_args", "validate", "load_digits_split", "build_data", "mlp_width", "build_model",
          "run_spec", "rank_seed", "evaluation_loader", "sync_buffers", "train")),
    Rung("train_ddp.py", "the production template",
         "A progress bar, torch.profiler traces, torch.compile, gradient compression, a crash drill.\n"
         "The tools for running and measuring real jobs; @record puts a rank's traceback in torchrun's summary.",
         ("parse_args", "step_range", "validate", "params_sha256", "progress_bar", "wrap_model",
          "StepProfiler", "say", "crash", "train", "main")),
]


def path(rung: Rung | str) -> Path:
    return SCRIPTS / (rung.file if isinstance(rung, Rung) else rung)


def lines(rung) -> list[str]:
    return path(rung).read_text().splitlines()


def changed_lines(a, b) -> int:
    """Lines added or removed going from rung a to rung b, blank lines not counted."""
    diff = difflib.unified_diff(lines(a), lines(b), n=0, lineterm="")
    return sum(1 for d in diff if d[:1] in "+-" and not d.startswith(("+++", "---")) and d[1:].strip())


def definitions(rung) -> dict[str, str]:
    """Top-level functions and classes of a rung: name -> source text."""
    src = path(rung).read_text().splitlines()
    return {n.name: "\n".join(src[min([n.lineno] + [d.lineno for d in n.decorator_list]) - 1:n.end_lineno])
            for n in ast.parse("\n".join(src)).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def changed_definitions(a, b) -> set[str]:
    """Functions and classes that rung b adds, or changes, relative to rung a."""
    old, new = definitions(a), definitions(b)
    return {name for name, code in new.items() if old.get(name) != code}


def table() -> list[dict]:
    """One row per rung: file, title, lines, changed lines from the rung before."""
    rows = []
    for k, r in enumerate(RUNGS):
        rows.append({"rung": k + 1, "file": r.file, "title": r.title, "lines": len(lines(r)),
                     "changed": changed_lines(RUNGS[k - 1], r) if k else len(lines(r))})
    return rows


_STYLE = ("font-family: monospace; font-size: 12px; white-space: pre; margin: 0; "
          "overflow-x: auto; border: 1px solid #ddd; padding: 6px; max-height: 480px; overflow-y: auto")
_COLORS = {"+": "#e6ffec", "-": "#ffebe9", "@": "#ddf4ff"}


def diff_html(a, b, context: int = 2) -> str:
    """The unified diff from rung a to rung b as colourised HTML (green added, red removed)."""
    out = []
    for d in difflib.unified_diff(lines(a), lines(b), path(a).name, path(b).name, n=context, lineterm=""):
        kind = "@" if d.startswith("@@") else d[:1] if d[:1] in "+-" and not d.startswith(("+++", "---")) else ""
        style = f' style="background:{_COLORS[kind]}"' if kind else ""
        out.append(f"<span{style}>{html.escape(d)}</span>")
    return f'<div style="{_STYLE}">' + "\n".join(out) + "</div>"


def show(k: int):
    """Notebook display of rung k (1-based): title, what it adds, and its diff from rung k - 1."""
    from IPython.display import HTML

    r, prev = RUNGS[k - 1], RUNGS[k - 2]
    head = (f"<b>Rung {k}: <code>{r.file}</code>, {html.escape(r.title)}</b> "
            f"({changed_lines(prev, r)} lines changed from <code>{prev.file}</code>)<br>"
            + "<br>".join(html.escape(s) for s in r.adds.splitlines()))
    return HTML(f"<p>{head}</p>" + diff_html(prev, r))


def source_html(k: int) -> str:
    """Rung k's whole file (1-based) as HTML, for the first rung."""
    return f'<div style="{_STYLE}">' + html.escape(path(RUNGS[k - 1]).read_text()) + "</div>"


def figure(rows=None):
    """Each rung's length and how much it changed from the one before, against MAX_CHANGED."""
    import matplotlib.pyplot as plt

    rows = rows or table()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    names = [f"{r['rung']}. {r['file']}" for r in rows][::-1]
    a.barh(names, [r["lines"] for r in rows][::-1], color="#7a9cc6")
    a.set_xlabel("lines in the file")
    b.barh(names[:-1], [r["changed"] for r in rows][::-1][:-1], color="#e0a458")
    b.axvline(MAX_CHANGED, color="crimson", ls="--", label=f"bound: {MAX_CHANGED} lines")
    b.set_xlabel("lines changed from the rung before")
    b.legend(loc="upper right", fontsize=8)
    fig.suptitle("The script ladder: each rung a whole program, a small diff of the one before")
    fig.tight_layout()
    return fig


def eval_figure(evals: dict):
    """Validation loss and accuracy after one epoch, per rung (rung -> eval record)."""
    import matplotlib.pyplot as plt

    ks = sorted(evals)
    fig, ax = plt.subplots(figsize=(7, 2.8))
    ax.bar([str(k) for k in ks], [evals[k]["loss"] for k in ks], color="#7a9cc6")
    for k in ks:
        ax.annotate(f"acc {evals[k]['acc']:.3f}", (str(k), evals[k]["loss"]), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xlabel("rung")
    ax.set_ylabel("validation loss (global)")
    ax.set_title("One epoch per rung, 2 ranks, default flags")
    fig.tight_layout()
    return fig
