"""One diagnosis from what the ranks left: who waits in which collective, who never came, why.

    from ddp_lab.autopsy import diagnose
    d = diagnose.diagnose_folder("/path/to/dumps", world_size=2)
    print(d.message())        # the job hung at collective #12: not every rank reached it
                              #   rank 0 waits in all_reduce #12 (train.py:57)
                              #   rank 1 never reached collective #12; its stack: train.py:71 in evaluate
                              # then the known pattern and its fix, and each rank's last frames
    d.headline                # the per-rank lines in one sentence
    d.to_dict()               # the same, structured (what `ddp-lab autopsy --json` prints)

The collective a waiting rank is in is its last Flight Recorder entry (op, sequence number,
sizes, the program's line); where a rank is otherwise comes from its Python stack.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ddp_lab.autopsy.evidence import (Collective, RankEvidence, in_collective, is_library, is_secondary,
                                      read_folder, user_frame)
from ddp_lab.autopsy.patterns import Pattern, recognise

FRAMES = 3  # the program's innermost frames shown per rank; the folder keeps the whole stacks
TRACEBACKS = "tracebacks.txt"  # the launcher writes every rank's whole stack there


@dataclass
class RankState:
    rank: int
    state: str                 # "waiting", "elsewhere", "finished", "failed", "unknown"
    collective: Collective | None = None  # the one it waits in (waiting) or its last one
    where: object = None       # Frame: the program's line it was at
    stack: list = field(default_factory=list)  # the program's frames, outermost first
    exception: str | None = None
    source: str | None = None  # where the stack came from
    stack_file: str | None = None  # the file it was read from
    loaders: dict = field(default_factory=dict)  # {local name: batches} of the data loaders it held

    def to_dict(self) -> dict:
        return {"rank": self.rank, "state": self.state,
                "collective": self.collective.to_dict() if self.collective else None,
                "where": self.where.to_dict() if self.where else None,
                "stack": [f.to_dict() for f in self.stack], "exception": self.exception,
                "source": self.source, "stack_file": self.stack_file, "loaders": self.loaders}


@dataclass
class Diagnosis:
    headline: str
    ranks: dict                       # {rank: RankState}
    kind: str                         # "mismatch", "missing", "agree", "no_collective"
    pattern: Pattern | None = None
    folder: str | None = None
    summary: str | None = None        # the first line of message(): what happened, in a sentence
    lines: list = field(default_factory=list)  # one per rank: the collective it waits in, or where it was
    tracebacks: str | None = None     # the file with every rank's whole stack (the launcher writes it)

    def message(self) -> str:
        """Top-down: what happened, one line per rank, the known pattern and its fix, then each
        rank's FRAMES innermost frames of the program and where the whole stacks are."""
        lines = [self.summary, *(f"  {x}" for x in self.lines)] if self.summary else [self.headline]
        if self.pattern:
            lines.append(self.pattern.sentence())
        stacks = [(r, s) for r, s in sorted(self.ranks.items()) if s.stack]
        if stacks:
            whole = (f"the whole stacks and tracebacks: {self.tracebacks}" if self.tracebacks else
                     "each rank's whole stack is in the file named beside it")
            lines.append(f"The program's last {FRAMES} frames per rank, innermost last ({whole}):")
        for r, s in stacks:
            chain = " > ".join(f"{f.short()} in {f.name}" for f in s.stack[-FRAMES:])
            named = "" if self.tracebacks or not s.stack_file else f", {self._relative(s.stack_file)}"
            lines.append(f"  rank {r} ({s.source}{named}): {chain}")
        if self.folder:
            lines.append(f"Every rank's dumps, Flight Recorder entries included: {self.folder}")
        return "\n".join(lines)

    def _relative(self, path: str) -> str:
        return os.path.relpath(path, self.folder) if self.folder else os.path.basename(path)

    def to_dict(self) -> dict:
        return {"headline": self.headline, "kind": self.kind,
                "pattern": self.pattern.to_dict() if self.pattern else None,
                "ranks": {str(r): s.to_dict() for r, s in sorted(self.ranks.items())},
                "summary": self.summary, "lines": self.lines, "folder": self.folder, "tracebacks": self.tracebacks}


def diagnose_folder(folder, world_size: int | None = None) -> Diagnosis | None:
    d = diagnose(read_folder(folder), world_size)
    if d is not None:
        d.folder = str(folder)
        if os.path.isfile(os.path.join(folder, TRACEBACKS)):
            d.tracebacks = os.path.join(str(folder), TRACEBACKS)
    return d


def diagnose(evidence: dict, world_size: int | None = None) -> Diagnosis | None:
    """None when nothing useful is known (then the caller says what it said before)."""
    ranks = sorted(set(evidence) | set(range(world_size or 0)))
    states = {r: _state(evidence.get(r) or RankEvidence(r)) for r in ranks}
    if not any(s.state != "unknown" for s in states.values()):
        return None
    waiting = {r: s for r, s in states.items() if s.state == "waiting"}
    if not waiting:
        known = [s for s in states.values() if s.where is not None]
        if not known:
            return None
        where = [f"rank {s.rank} is at {s.where.short()} in {s.where.name}" for s in known]
        return Diagnosis(f"no rank was waiting in a collective: {'; '.join(where)}", states, "no_collective",
                         summary="no rank was waiting in a collective:", lines=where)
    seqs = [s.collective.seq for s in waiting.values() if s.collective and s.collective.seq is not None]
    target = max(seqs) if seqs else None
    parts = [f"rank {r} {'waits' if s.source == 'live' else 'was waiting'} in {_name(s.collective, target)}"
             for r, s in sorted(waiting.items())]
    groups = {_signature(s.collective) for s in waiting.values()}
    explain, kind = "", "agree"
    if len(groups) > 1:
        known = [s.collective for s in waiting.values() if s.collective]
        ops = {c.op for c in known}
        sizes = {_sizes(c.sizes) for c in known if c.seq is not None}  # from the Flight Recorder
        if len(ops) > 1:
            explain = ": the ranks called different collectives"
        elif len(sizes) > 1:
            explain = f": the ranks called {ops.pop()} with different sizes ({' vs '.join(sorted(sizes))})"
        else:
            sites = sorted({c.site.short() for c in known if c.site})
            explain = f": the ranks are in different calls of the program ({' vs '.join(sites)})"
        kind = "mismatch"
    number = f"collective #{target}" if target is not None else "that collective"
    for r, s in sorted(states.items()):
        if r in waiting:
            continue
        other = _instead(s, target, waiting)
        if other:  # it called collective #N too, but another one: a mismatch, not a missing rank
            parts.append(f"rank {r} called {other} instead{_then(s)}")
            if kind != "mismatch":
                ops = {w.collective.op for w in waiting.values() if w.collective}
                explain = (": the ranks called different collectives" if s.collective.op not in ops
                           else f": the ranks called {s.collective.op} with different sizes")
            kind = "mismatch"
            continue
        kind = "missing" if kind == "agree" else kind
        if s.state == "finished":
            after = f" after collective #{s.collective.seq}" if s.collective else ""
            parts.append(f"rank {r} never reached {number}: it finished the program{after}")
        elif s.state == "failed" and is_secondary(s.exception):
            at = f" at {s.where.short()} in {s.where.name}" if s.where else ""
            parts.append(f"rank {r} never reached {number}: it lost its peers{at}")
        elif s.state == "failed":
            at = f" at {s.where.short()} in {s.where.name}" if s.where else ""
            parts.append(f"rank {r} never reached {number}: it failed first{at}: "
                         f"{(s.exception or '')[:200]}")
        elif s.state == "elsewhere":
            parts.append(f"rank {r} never reached {number}; its stack: "
                         f"{s.where.short()} in {s.where.name}")
        else:
            parts.append(f"rank {r} could not be inspected")
    if kind == "agree":
        explain = (": every rank is in the same collective, so the ranks agree; the collective itself "
                   "is stuck (a network problem, a rank of another node?)")
    pattern = None
    try:
        pattern = recognise({r: s.stack or _frames_of(s.collective) for r, s in waiting.items()},
                            others_elsewhere=kind == "mismatch" or any(
                                s.state in ("finished", "failed", "elsewhere") for s in states.values()),
                            mismatch=kind == "mismatch",
                            ranks={r: (s.stack, s.loaders) for r, s in states.items() if s.state != "unknown"},
                            inside={r: s.stack for r, s in states.items() if s.stack and (
                                s.state == "waiting" or s.state == "failed" and is_secondary(s.exception))})
    except Exception:  # noqa: BLE001 - the pattern is a bonus; the diagnosis stands without it
        pattern = None
    at = f"at collective #{target}" if target is not None else "in a collective"
    summary = {"mismatch": f"the job hung {at}{explain}",
               "missing": f"the job hung {at}: not every rank reached it",
               "agree": f"the job hung {at}{explain}"}[kind]
    return Diagnosis("; ".join(parts) + explain, states, kind, pattern, summary=summary, lines=parts)


def _state(e: RankEvidence) -> RankState:
    s = _state_of(e)
    s.loaders = dict(e.loaders)
    return s


def _state_of(e: RankEvidence) -> RankState:
    last = e.collectives[-1] if e.collectives else None
    frames = [f for f in e.stack if not is_library(f.file)]
    where = user_frame(e.stack)
    if e.stack and in_collective(e.stack) and (e.exception is None or is_secondary(e.exception)):
        if last is not None and last.site is None:  # dumped without its frames: the stack says where
            last.site = where
        collective = last if last is not None and _same_line(last.site, where) else _from_stack(e.stack, where)
        return RankState(e.rank, "waiting", collective, where, frames, e.exception, e.stack_from, e.stack_file)
    if e.exception and e.stack:
        return RankState(e.rank, "failed", last, where, frames, e.exception, e.stack_from, e.stack_file)
    if e.stack:
        return RankState(e.rank, "elsewhere", last, where, frames, e.exception, e.stack_from, e.stack_file)
    if e.finished:
        return RankState(e.rank, "finished", last, None, [], None, "exit")
    return RankState(e.rank, "unknown", last, None, [], e.exception, None)


def _instead(s: RankState, target, waiting: dict) -> str | None:
    """"broadcast #5 (train.py:24)" when a rank that is not waiting called collective #target with
    another op or other sizes than the ranks waiting in it; None otherwise."""
    c = s.collective
    if target is None or c is None or c.seq != target:
        return None
    theirs = [w.collective for w in waiting.values() if w.collective and w.collective.seq == target]
    if not theirs or all((w.op, _sizes(w.sizes)) == (c.op, _sizes(c.sizes)) for w in theirs):
        return None
    site = c.site or s.where
    return f"{c.op} #{c.seq} {_sizes(c.sizes)}" + (f" ({site.short()})" if site else "")


def _then(s: RankState) -> str:
    if s.state == "failed":
        return ", then lost its peers" if is_secondary(s.exception) else \
            f", then failed: {(s.exception or '')[:200]}"
    return {"finished": ", then finished the program"}.get(s.state, "")


def _same_line(a, b) -> bool:
    return a is not None and b is not None and a.file == b.file and a.line == b.line


def _from_stack(stack, where) -> Collective:
    """The collective as the stack shows it, when no Flight Recorder entry matches."""
    innermost = next((f for f in reversed(stack) if "distributed" in f.file and f.name not in ("wrapper",)), None)
    op = innermost.name if innermost else "backward's gradient all-reduce"
    return Collective(None, op, [], "", where, [])


def _frames_of(c: Collective | None) -> list:
    return [f for f in c.frames if not is_library(f.file)] if c else []


def _name(c: Collective | None, target) -> str:
    if c is None:
        return "a collective"
    seq = f" #{c.seq}" if c.seq is not None else ""
    at = f" ({c.site.short()})" if c.site else ""
    return f"{c.op}{seq}{at}"


def _sizes(sizes) -> str:
    """[[5]] -> "[5]"; [[2, 3], [4]] -> "[2, 3] [4]"."""
    return " ".join(str(list(x)) for x in sizes) if sizes else "[]"


def _signature(c: Collective | None):
    if c is None:
        return None
    return (c.op, c.site.short() if c.site else None) if c.seq is None else (
        c.seq, c.op, str(c.sizes), c.site.short() if c.site else None)
