"""The script ladder: scripts/minimal_ddp.py grown into scripts/train_ddp.py in runnable rungs.

Each rung is a whole program (copy any of them) and a small diff of the one before; notebook 06b
renders the diffs and tests/test_ladder.py keeps the ladder a ladder:

- no rung changes more than MAX_CHANGED lines of the one before (the top rung MAX_CHANGED_TOP);
- a rung adds or changes exactly the functions, classes and module constants it declares in
  `changes` (so a fix made in train_ddp.py alone, and not in the rungs below it, fails the test);
- every rung runs on its own under torchrun;
- the key lines notebook 06b shows first for each rung (`KEYS`) are in that rung and new in it
  (tests/test_ladder_steps.py), so the excerpts cannot drift from the files.
"""
from __future__ import annotations

import ast
import difflib
import html
from dataclasses import dataclass
from pathlib import Path

from ddp_lab.engine.launch import ROOT

SCRIPTS = ROOT / "scripts"
MAX_CHANGED = 160  # changed lines (added + removed, blank lines not counted) between two rungs
MAX_CHANGED_TOP = 460  # train_ddp.py, the production rung: about 140 of its lines are sharded
                       # checkpoints (--ckpt-format dcp, with its damage checks), about 70 the data's checks
                       # (Task.check_*, each a one-line fix), about 60 StepLog (logging, the progress bar,
                       # the non-finite guard, out of train()), about 50 its docstring (the run recipe)


@dataclass(frozen=True)
class Rung:
    file: str
    title: str
    adds: str        # two lines: what the rung adds, and why
    changes: tuple   # the functions, classes and module constants it adds or changes


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
         ("os_error_in", "describe_write_error", "atomic_save", "check_writable", "SPEC_FLAGS", "run_spec",
          "read_checkpoint", "file_fingerprint", "resume_state", "resume", "save_checkpoint", "check_start",
          "train")),
    Rung("ddp7_data_models.py", "your data and your model",
         "CIFAR-10, ImageFolder, synthetic data; a CNN, ResNet-18, dropout, BatchNorm, SyncBatchNorm; persistent workers.\n"
         "Own random streams per rank after identical weights; rank 0's BatchNorm stats for evaluation.",
         ("parse_args", "validate", "load_digits_split", "build_data", "mlp_width", "build_model",
          "SPEC_FLAGS", "run_spec", "rank_seed", "evaluation_loader", "sync_buffers", "train")),
    Rung("ddp8_task.py", "any task",
         "Classification or regression, tuples or dict batches, models called with keywords, a collate_fn:\n"
         "one class, Task, says how a batch reaches the model and what its loss and metrics are; the loops only call it.",
         ("parse_args", "validate", "build_data", "Task", "SPEC_FLAGS", "run_spec", "evaluation_loader", "evaluate",
          "train")),
    Rung("train_ddp.py", "the production template",
         "A progress bar, torch.profiler traces, torch.compile, gradient compression, TF32, gradients as bucket views,\n"
         "a crash drill, sharded checkpoints (--ckpt-format dcp) for models too big to gather on one rank; "
         "@record names a rank's traceback; the data's checks (targets, NaN inputs, output shapes), each a\n"
         "one-line fix; a diverged run stopped (StepLog); loader workers from a fork server on GPUs.",
         ("TORCH_FLOOR", "parse_args", "step_range", "validate", "params_sha256", "progress_bar", "set_tf32", "wrap_model",
          "Task", "SPEC_FLAGS", "workers_start", "evaluation_loader",
          "StepProfiler", "StepLog", "say", "crash", "train", "main", "read_checkpoint", "file_fingerprint", "resume_state",
          "latest_checkpoint", "format_error", "resume", "save_checkpoint", "save_sharded", "load_sharded")),
]


@dataclass(frozen=True)
class Key:
    """A region of a rung that carries its idea: in definition `defn` (a top-level function or
    class), the lines from the first one containing `first` to the next one containing `last`."""
    defn: str
    first: str
    last: str
    why: str         # one sentence: what these lines do


# The 10-20 lines that carry each rung's idea (rung number -> regions), shown before the full diff.
KEYS = {
    2: (Key("evaluation_loader", "def evaluation_loader", "return DataLoader",
            "Each validation sample goes to exactly one rank, so no padding copy is counted twice."),
        Key("evaluate", "stats = torch.zeros(3", "dist.all_reduce(stats)",
            "Sums of loss, correct answers and count, all-reduced: global numbers, not rank 0's shard."),
        Key("Window", "def record", "samples_per_s=",
            "One all-reduce per log record turns every rank's losses and samples into a global mean and rate.")),
    3: (Key("ResumableSampler", "def __iter__", "return iter(rest",
            "The epoch's shuffled order without its first `start` samples, sharded: a resume neither repeats nor skips."),
        Key("atomic_save", "with open(tmp", "os.replace(tmp, path)",
            "Write a temporary file, fsync it, then rename: a crash mid-save leaves the last good file."),
        Key("train", "sampler.start = position", "sampler.start = position",
            "Each epoch starts where the checkpoint says the data stopped."),
        Key("train", "if last_pt and step % args.save_every", "saved_step = step",
            "Every --save-every steps, all ranks join the save; it records the exact sample position.")),
    4: (Key("is_sync_step", "return (i + 1)", "return (i + 1)",
            "The last micro-batch of each group of --accum-steps (or of the epoch) is the one that syncs."),
        Key("train", "sync = is_sync_step(", "grad_norm, skipped = optimizer_step",
            "The other micro-batches run forward and backward under no_sync: K micro-batches, one all-reduce."),
        Key("optimizer_step", "scaler.unscale_(optimizer)", "scaler.step(optimizer)",
            "Clip the true gradients, and skip the step on every rank at once when their norm is not finite.")),
    5: (Key("validate", "for name in (", "raise UsageError(f\"--{name",
            "Flags are checked before any process group exists, the same way on every rank."),
        Key("agree", "errors = [None]", "raise UsageError(first)",
            "A problem one rank finds (its data, its disk) becomes every rank's error."),
        Key("main", "except UsageError as e:", "sys.exit(2)",
            "One message from rank 0 and exit code 2, instead of a traceback per rank.")),
    6: (Key("check_writable", "with open(probe", "os.fsync(f.fileno())",
            "Before the first step, write a probe file where checkpoints will go."),
        Key("check_writable", "except OSError as e:", "+ (\"free space",
            "An unwritable folder or a full disk becomes one sentence that says what to do."),
        Key("read_checkpoint", "ckpt = torch.load(path, map_location", "return None, f\"cannot read",
            "A checkpoint is loaded as data only (weights_only), and an unreadable one is named."),
        Key("read_checkpoint", "differ = [k for k", "return None, (f\"checkpoint",
            "A checkpoint of another data set or model shape is refused, with both settings named.")),
    7: (Key("rank_seed", "return seed + 1_000_003", "return seed + 1_000_003",
            "Each rank's own seed, far from the seed that built the identical initial weights."),
        Key("train", "if args.sync_bn:", "convert_sync_batchnorm",
            "--sync-bn swaps every BatchNorm for SyncBatchNorm (GPU only): statistics over the global batch."),
        Key("train", "# From here on each rank", "random.seed(rank_seed(args.seed, rank))",
            "After the weights are built, each rank draws its own dropout masks and augmentations."),
        Key("sync_buffers", "for buffer in model.buffers()", "dist.broadcast(buffer",
            "Before evaluating, rank 0's BatchNorm statistics are copied to every rank."),
        Key("train", "sync_buffers(raw_model)", "sync_buffers(raw_model)",
            "So every rank evaluates the same model.")),
    8: (Key("Task", "def forward(self, model, batch)", "return model(**x)",
            "A dict's entries become the model's keyword arguments; otherwise the input is passed as it is."),
        Key("train", "task = Task(args.task, outputs)", "task = Task(args.task, outputs)",
            "The task is built from --task and the number of outputs build_data returns (a subclass of your own "
            "is built here instead)."),
        Key("train", "for batch in loader:", "y = task.target(batch)",
            "The loop no longer unpacks (x, y): the task moves any batch to the device and finds its target."),
        Key("train", "loss = task.loss(task.forward(", "loss = task.loss(task.forward(",
            "The task's loss on the model's output: cross-entropy for class indices, mean squared error for values."),
        Key("evaluate", "stats = 0", "return task.metrics(stats)",
            "As many sums as the task returns, all-reduced: RMSE from the global mean squared error, "
            "never a mean of each rank's RMSE.")),
    9: (Key("main", "@record", "@record",
            "torchrun's failure summary then holds the failing rank's own traceback."),
        Key("wrap_model", "if args.compile:", "return ddp_model",
            "The model's forward compiled in place before DDP wraps it (one graph per bucket), DDP with tunable buckets that "
            "hold the gradients (each .grad a view into its bucket), "
            "an optional 16-bit gradient compression hook."),
        Key("params_sha256", "h = hashlib.sha256()", "return h.hexdigest()",
            "A hash of every weight's bytes: two runs ended equal, bit for bit, if their hashes match."),
        Key("train", "profiler = StepProfiler(", "profiler = StepProfiler(",
            "A torch.profiler trace of the steps --profile-steps names."),
        Key("train", "if args.crash_at_step == step", "crash(rank, step, attempt)",
            "A crash drill: SIGKILL every rank after one step, to rehearse torchrun's restart and the resume."),
        Key("parse_args", 'a("--ckpt-format"', "shared storage",
            "--ckpt-format dcp: a checkpoint folder that every rank writes its own part of."),
        Key("save_sharded", "dcp.save(parts", "dcp.save(parts",
            "torch.distributed.checkpoint writes each rank's part; no rank gathers the whole model."),
        Key("save_sharded", "os.replace(tmp, path)", "os.replace(tmp, path)",
            "Only the complete folder takes the name last.dcp: a crash mid-save leaves the previous one.")),
}


def path(rung: Rung | str) -> Path:
    return SCRIPTS / (rung.file if isinstance(rung, Rung) else rung)


def lines(rung) -> list[str]:
    return path(rung).read_text().splitlines()


def changed_lines(a, b) -> int:
    """Lines added or removed going from rung a to rung b, blank lines not counted."""
    diff = difflib.unified_diff(lines(a), lines(b), n=0, lineterm="")
    return sum(1 for d in diff if d[:1] in "+-" and not d.startswith(("+++", "---")) and d[1:].strip())


def definitions(rung) -> dict[str, str]:
    """Top-level functions, classes and module constants (SPEC_FLAGS = {...}) of a rung: name -> source
    text. A constant counts as much as a function: a fix to one must reach every rung that has it."""
    src = path(rung).read_text().splitlines()
    found = {}
    for n in ast.parse("\n".join(src)).body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            found[n.name] = "\n".join(src[min([n.lineno] + [d.lineno for d in n.decorator_list]) - 1:n.end_lineno])
        elif isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            found[n.targets[0].id] = "\n".join(src[n.lineno - 1:n.end_lineno])
    return found


def changed_definitions(a, b) -> set[str]:
    """Functions, classes and module constants that rung b adds, or changes, relative to rung a."""
    old, new = definitions(a), definitions(b)
    return {name for name, code in new.items() if old.get(name) != code}


def table() -> list[dict]:
    """One row per rung: file, title, lines, changed lines from the rung before."""
    rows = []
    for k, r in enumerate(RUNGS):
        rows.append({"rung": k + 1, "file": r.file, "title": r.title, "lines": len(lines(r)),
                     "changed": changed_lines(RUNGS[k - 1], r) if k else len(lines(r)),
                     "bound": MAX_CHANGED_TOP if k == len(RUNGS) - 1 else MAX_CHANGED})
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


def added_lines(a, b) -> set[int]:
    """0-based numbers of the lines of rung b that are new against rung a (added or changed)."""
    sm = difflib.SequenceMatcher(None, lines(a), lines(b), autojunk=False)
    return {j for op, _, _, j1, j2 in sm.get_opcodes() if op in ("insert", "replace") for j in range(j1, j2)}


def key_region(rung, key: Key) -> tuple[int, int]:
    """(start, end) 0-based line numbers of `key` in the rung's file, end exclusive; KeyError or
    ValueError when the definition or the marker lines are gone (the excerpt would have drifted)."""
    src = lines(rung)
    node = next(n for n in ast.parse("\n".join(src)).body
                if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == key.defn)
    lo = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    body = range(lo, node.end_lineno)
    start = next(i for i in body if key.first in src[i])
    end = next(i for i in body if i >= start and key.last in src[i]) + 1
    return start, end


def key_lines(k: int) -> list[tuple[Key, list[tuple[int, str, bool]]]]:
    """Rung k's key regions: for each, (line number from 1, text, new against rung k - 1)."""
    r, prev = RUNGS[k - 1], RUNGS[k - 2]
    src, new = lines(r), added_lines(prev, r)
    out = []
    for key in KEYS[k]:
        start, end = key_region(r, key)
        out.append((key, [(i + 1, src[i], i in new) for i in range(start, end)]))
    return out


def key_html(k: int) -> str:
    """Rung k's key regions as HTML: the sentence, then the lines (new ones green, with their numbers)."""
    parts = []
    for key, rows in key_lines(k):
        code = "\n".join(f'<span style="background:{_COLORS["+"] if added else "transparent"}">'
                         f"{n:4d} {'+' if added else ' '} {html.escape(text)}</span>" for n, text, added in rows)
        parts.append(f"<p style='margin:8px 0 2px 0'><code>{key.defn}</code>: {html.escape(key.why)}</p>"
                     f'<div style="{_STYLE}">{code}</div>')
    return "".join(parts)


def steps(k: int):
    """Notebook display of rung k (1-based): title, what it adds, its key lines with a sentence
    each, then its whole diff from rung k - 1 folded in a <details> element (one click away)."""
    from IPython.display import HTML

    r, prev = RUNGS[k - 1], RUNGS[k - 2]
    shown = sum(len(rows) for _, rows in key_lines(k))
    head = (f"<b>Rung {k}: <code>{r.file}</code>, {html.escape(r.title)}</b><br>"
            + "<br>".join(html.escape(s) for s in r.adds.splitlines()))
    fold = (f"<details><summary>The whole diff from <code>{prev.file}</code>: {changed_lines(prev, r)} lines "
            f"changed, in {len(r.changes)} definitions ({shown} of its lines shown above)</summary>"
            + diff_html(prev, r) + "</details>")
    return HTML(f"<p>{head}</p>" + key_html(k) + fold)


def load(rung):
    """Import a rung file as a module (it runs main() only under __main__), to call its functions."""
    import importlib.util

    r = RUNGS[rung - 1] if isinstance(rung, int) else rung
    spec = importlib.util.spec_from_file_location(Path(r.file).stem, path(r))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    b.axvline(MAX_CHANGED, color="crimson", ls="--",
              label=f"bound: {MAX_CHANGED} lines (the production rung: {MAX_CHANGED_TOP})")
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
