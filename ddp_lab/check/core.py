"""Findings, the rule registry, the notebook-section table, and `# ddp-lab: ignore[...]`.

A rule is a small function registered with @rule(id, sentence, fix, section, kind):
- kind "python": called with a pyfacts.Module, yields Hit(node) (or Hit(node, "specific message"));
- kind "shell": called with a shell.Script (lines, commands, broken continuations), yields
  Hit(line number, ..., col=...).
The rule modules (rules_*.py, rules_more.py, shell.py) register themselves when ddp_lab.check is imported.
"""
from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass, field
from typing import Callable, Iterable

# The notebook section that teaches each bug, in one place: rules name a key, never a title.
# Titles are the `##`/`###` headings as they are in the notebooks (tests/test_check_cli.py
# checks that each one still exists).
SECTIONS = {
    "backend": ("notebooks/00_first_launch.ipynb", "3. The environment checklist"),
    "ranks": ("notebooks/00_first_launch.ipynb", "1. Nodes, devices, processes, ranks"),
    "comments": ("notebooks/00_first_launch.ipynb", "Why a widely copied command breaks the shell"),
    "bang": ("notebooks/00_first_launch.ipynb", "5. Why not `!torchrun` in a cell?"),
    "dataparallel": ("notebooks/01_dataparallel_vs_ddp.ipynb", "1. Two dataflows"),
    "seeds": ("notebooks/01_dataparallel_vs_ddp.ipynb", "2.2 `seed_everything(42 + rank)` and DDP's broadcast"),
    "buffers": ("notebooks/01_dataparallel_vs_ddp.ipynb", "2.3 `broadcast_buffers=False` and BatchNorm"),
    "set_epoch": ("notebooks/02_sampler_and_metrics.ipynb", "2. `shuffle` and `set_epoch`"),
    "global_loss": ("notebooks/02_sampler_and_metrics.ipynb", "4. Global loss: mean of means vs `[sum, count]`"),
    "hang": ("notebooks/02_sampler_and_metrics.ipynb", "5. Uneven batches per rank: the hang, then the fix"),
    "amp": ("notebooks/04_mixed_precision.ipynb", "5. bf16 needs no scaler; `torch.cuda.amp` is deprecated"),
    "no_sync": ("notebooks/05_gradient_accumulation.ipynb",
                "3. How DDP decides to all-reduce, and what `no_sync` changes"),
    "accumulation": ("notebooks/05_gradient_accumulation.ipynb",
                     "4. The articles' accumulation code, the fix, and the misuse, on 2 ranks"),
    "what_to_save": ("notebooks/06_checkpointing.ipynb", "1. What a checkpoint must hold"),
    "prefixes": ("notebooks/06_checkpointing.ipynb", "2. The `module.` and `_orig_mod.` prefixes"),
    "load": ("notebooks/06_checkpointing.ipynb", "4. Reading a checkpoint back on N ranks"),
    "skipped": ("notebooks/07_troubleshooting.ipynb", "1. A rank skips a collective"),
    "launch": ("notebooks/07_troubleshooting.ipynb", "Deep dive: launch and rendezvous failures"),
    "slurm": ("notebooks/10_laptop_to_cluster.ipynb", "3. Two real machines, and SLURM"),
    "divergence": ("notebooks/07_troubleshooting.ipynb", "Deep dive: silent divergence, replicas that drift apart"),
    "identity": ("notebooks/07_troubleshooting.ipynb", "Deep dive: wrong identity"),
}


@dataclass(frozen=True)
class Rule:
    id: str
    kind: str           # "python" or "shell"
    sentence: str       # what is wrong, one sentence
    fix: str            # what to write instead
    section: str | None  # a SECTIONS key, or None when no notebook shows it yet
    func: Callable

    @property
    def see(self) -> str:
        if self.section is None:
            return f"docs/check.md#{self.id.lower()}"
        notebook, title = SECTIONS[self.section]
        return f'{notebook}, section "{title}"'


RULES: dict[str, Rule] = {}


def rule(id: str, sentence: str, fix: str, section: str | None = None, kind: str = "python"):
    """Register a rule function under a stable id."""
    if section is not None and section not in SECTIONS:
        raise KeyError(f"{id}: unknown section {section!r}")

    def register(func):
        RULES[id] = Rule(id, kind, sentence, fix, section, func)
        return func
    return register


@dataclass
class Hit:
    """What a rule function yields: where (an AST node or a line number) and, optionally, a
    message more specific than the rule's sentence."""
    where: object
    message: str | None = None
    col: int = 0


@dataclass
class Finding:
    id: str
    path: str
    line: int
    col: int
    message: str
    fix: str
    see: str
    cell: int | None = None     # notebooks: 1-based cell number; line is then within the cell
    section: tuple | None = None  # (notebook, section title) that teaches it, or None
    span: tuple = field(default=(0, 0), repr=False, compare=False)  # lines an ignore comment may sit on

    def location(self) -> str:
        cell = f"cell {self.cell}:" if self.cell is not None else ""
        return f"{self.path}:{cell}{self.line}:{self.col}"

    def to_dict(self) -> dict:
        notebook, section = self.section or (None, None)
        return {"path": self.path, "cell": self.cell, "line": self.line, "col": self.col, "id": self.id,
                "message": self.message, "fix": self.fix, "see": self.see, "notebook": notebook, "section": section}


def rules_of(kind: str, select: Iterable[str] | None = None, ignore: Iterable[str] = ()) -> list[Rule]:
    chosen = [r for r in RULES.values() if r.kind == kind and r.id not in set(ignore)]
    if select:
        wanted = set(select)
        chosen = [r for r in chosen if r.id in wanted]
    return sorted(chosen, key=lambda r: r.id)


# ---------------------------------------------------------------- suppression
IGNORE = re.compile(r"#\s*ddp-lab:\s*ignore(?:\[([A-Za-z0-9_,\s]*)\])?")


def ignore_comments(text: str, python: bool) -> dict[int, set[str] | None]:
    """line -> ids ignored on it (None: every id). Python comments come from tokenize, so a
    `# ddp-lab: ignore` inside a string does not count."""
    comments: list[tuple[int, str]] = []
    if "ddp-lab" not in text:
        return {}
    if python:
        try:
            for tok in tokenize.generate_tokens(io.StringIO(text).readline):
                if tok.type == tokenize.COMMENT:
                    comments.append((tok.start[0], tok.string))
        except (tokenize.TokenError, SyntaxError):
            python = False
    if not python:
        comments = [(i, line) for i, line in enumerate(text.splitlines(), 1) if "#" in line]
    out: dict[int, set[str] | None] = {}
    for line, comment in comments:
        m = IGNORE.search(comment)
        if m:
            ids = None if m.group(1) is None else {s.strip().upper() for s in m.group(1).split(",") if s.strip()}
            out[line] = ids
    return out


def suppressed(finding: Finding, ignores: dict) -> bool:
    first, last = finding.span if finding.span != (0, 0) else (finding.line, finding.line)
    for line in range(first, last + 1):
        if line in ignores and (ignores[line] is None or finding.id in ignores[line]):
            return True
    return False
