"""Known causes of a hang, recognised in the program's source at the lines the ranks waited on.

Each names the lesson that teaches it and the `ddp-lab check` rule that finds it before a run
(None where no static rule can: a NaN appears at run time).
"""
from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from dataclasses import dataclass

_RANK_WORDS = re.compile(r"rank|is_main|is_master|main_process|is_primary|is_leader", re.I)
_NAN_WORDS = re.compile(r"nan|isfinite|inf\b", re.I)

# The same sections ddp_lab.check links its rules to (kept in step by importing them).
_FALLBACK_SECTIONS = {
    "skipped": ("notebooks/07_troubleshooting.ipynb", "1. A rank skips a collective"),
    "hang": ("notebooks/02_sampler_and_metrics.ipynb", "5. Uneven batches per rank: the hang, then the fix"),
}
MISMATCH_SECTION = ("notebooks/07_troubleshooting.ipynb", "Deep dive: mismatched collectives, different shapes or dtypes")


def _section(key: str):
    try:
        from ddp_lab.check.core import SECTIONS
        return SECTIONS[key]
    except Exception:  # noqa: BLE001 - the link is a courtesy; the fallback says the same
        return _FALLBACK_SECTIONS[key]


@dataclass
class Pattern:
    name: str            # "rank_condition", "skip", "left_loop", "uneven", "mismatch"
    words: str           # what it is, in words
    evidence: str        # the source line that shows it, "file:line `code`"
    notebook: str
    section: str
    rule: str | None     # ddp-lab check rule id
    no_rule: str = "it depends on the data"  # why no static rule can see it, when rule is None
    flagged: bool | None = None  # did `ddp-lab check` flag this very code? (None: not checked)
    fix: str = ""        # what to change, in words

    def sentence(self) -> str:
        if not self.rule:
            rule = f"no `ddp-lab check` rule can see it before a run ({self.no_rule})"
        elif self.flagged:
            rule = f"`ddp-lab check` rule {self.rule} flags this code before a run"
        else:
            rule = (f"`ddp-lab check` rule {self.rule} looks for this pattern before a run, but does not "
                    f"flag this code")
        fix = f" Fix: {self.fix}." if self.fix else ""
        return (f"Known pattern: {self.words} ({self.evidence}).{fix} Lesson: {self.notebook}, "
                f"section \"{self.section}\"; {rule}.")

    def to_dict(self) -> dict:
        return {"name": self.name, "words": self.words, "evidence": self.evidence, "fix": self.fix,
                "notebook": self.notebook, "section": self.section, "rule": self.rule,
                "flagged": self.flagged}


@functools.lru_cache(maxsize=32)
def _parse(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return ast.parse(text), text.splitlines()
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None, []


def _ancestors(tree, line: int) -> list:
    """Nodes whose span holds `line`, outermost first (statements and their bodies)."""
    chain, node = [], tree
    while True:
        child = next((c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)
                      and c.lineno <= line <= (c.end_lineno or c.lineno)), None)
        if child is None:
            return chain
        chain.append(child)
        node = child


def _code(lines, lineno) -> str:
    """The source line, without its trailing `# comment` (a `#` inside a string stays)."""
    if not 0 < lineno <= len(lines):
        return ""
    line = lines[lineno - 1]
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line).readline):
            if tok.type == tokenize.COMMENT:
                line = line[:tok.start[1]]
                break
    except (tokenize.TokenError, SyntaxError):  # the line opens a bracket it does not close
        pass
    return line.strip()


def rank_condition(frames) -> tuple | None:
    """(frame, if-line) when a user frame's line sits in an `if` that tests the rank."""
    for f in reversed(frames):
        tree, lines = _parse(f.file)
        if tree is None:
            continue
        for node in reversed(_ancestors(tree, f.line)):
            # `if rank == 0: a() else: b()` gives every rank a collective: a mismatch, not this
            if isinstance(node, ast.If) and not node.orelse and _RANK_WORDS.search(ast.unparse(node.test)):
                return f, node.lineno, _code(lines, node.lineno)
    return None


def skip_in_loop(frames) -> tuple | None:
    """(frame, line, code, nan?) when the loop around a user frame skips ahead (`continue`) before
    it. A `break` leaves the loop instead: left_loop."""
    for f in reversed(frames):
        tree, lines = _parse(f.file)
        if tree is None:
            continue
        for loop in reversed([n for n in _ancestors(tree, f.line) if isinstance(n, (ast.For, ast.While))]):
            for node in _walk_loop_body(loop):
                if isinstance(node, ast.If) and node.lineno < f.line and any(
                        isinstance(s, ast.Continue) for s in _walk_loop_body(node)):
                    return f, node.lineno, _code(lines, node.lineno), bool(_NAN_WORDS.search(ast.unparse(node.test)))
    return None


def in_loop(frames) -> tuple | None:
    """(frame index, loop node, source lines) of the innermost loop around a user frame's line."""
    for i in range(len(frames) - 1, -1, -1):
        tree, lines = _parse(frames[i].file)
        if tree is None:
            continue
        loops = [n for n in _ancestors(tree, frames[i].line) if isinstance(n, (ast.For, ast.While))]
        if loops:
            return i, loops[-1], lines
    return None


def _inside(frames, path: str, loop) -> bool:
    return any(f.file == path and loop.lineno <= f.line <= (loop.end_lineno or loop.lineno) for f in frames)


def loop_exits(frames, i: int, loop, lines) -> list:
    """[(line, code, how)]: the ways out of `loop` (frames[i]'s innermost loop) before its data
    runs out, each at the statement that decides it: a `break` or `return` (at the `if` or `except`
    around it), an exception caught by a `try` around the loop, in its function or a caller's."""
    out = []
    parents = {c: n for n in ast.walk(loop) for c in ast.iter_child_nodes(n)}
    for node in _walk_loop_body(loop):
        if isinstance(node, (ast.Break, ast.Return)):
            decider = parents.get(node)
            while decider is not None and decider is not loop and not isinstance(decider, (ast.If, ast.ExceptHandler)):
                decider = parents.get(decider)
            at = node if decider is None or decider is loop else decider
            how = "a `break`" if isinstance(node, ast.Break) else "a `return`"
            if isinstance(at, ast.ExceptHandler):
                how = f"{how} after an exception caught"
            out.append((at.lineno, _code(lines, at.lineno), how))
    for k in range(i, -1, -1):  # a try around the loop, or around a call that leads to it
        tree, src = _parse(frames[k].file)
        line = loop.lineno if k == i else frames[k].line
        for node in reversed(_ancestors(tree, line) if tree is not None else []):
            if isinstance(node, ast.Try) and node.body[0].lineno <= line <= node.body[-1].end_lineno:
                for h in node.handlers:  # one that raises again, or catches Ctrl-C, is no early stop
                    if not any(isinstance(x, ast.Raise) for x in h.body) and not _interrupt(h):
                        out.append((h.lineno, _code(src, h.lineno), "an exception caught"))
    return sorted(set(out))


def _interrupt(handler) -> bool:
    names = ast.unparse(handler.type) if handler.type is not None else ""
    return bool(names) and not re.sub(r"KeyboardInterrupt|SystemExit|[\s(),]", "", names)


def _loader_sizes(rank: int, others: list, ranks: dict):
    """(name, {rank: batches}) for a data loader held under one name by `rank` and by the ranks
    that left the loop, or None when they share no loader name."""
    mine = ranks.get(rank, ((), {}))[1]
    for name in sorted(mine):
        theirs = {q: ranks[q][1][name] for q in others if name in ranks.get(q, ((), {}))[1]}
        if theirs:
            return name, {rank: mine[name], **theirs}
    return None


def left_or_ran_out(waiting: dict, ranks: dict) -> Pattern | None:
    """A rank is inside a loop that another rank is no longer in: did that rank's data run out
    first (uneven inputs) or did it leave the loop early (a break, an early stop, a caught
    exception)? The data loaders both held decide when they hold one under the same name (as many
    batches on every rank: it left early); else the loop's source: a way out before the data
    ends, or none."""
    for r, frames in waiting.items():
        found = in_loop(frames)
        if found is None:
            continue
        i, loop, lines = found
        f = frames[i]
        gone = sorted(q for q, (stack, _) in ranks.items() if q != r and not _inside(stack, f.file, loop))
        if ranks and not gone:
            continue
        exits = loop_exits(frames, i, loop, lines)
        if not exits and isinstance(loop, ast.While) and isinstance(loop.test, ast.Constant) and loop.test.value:
            continue  # `while True:` without a way out: nobody left it
        sizes = _loader_sizes(r, gone, ranks)
        who = f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))}" if gone else "another rank"
        at = f"{_short(f.file)}:{loop.lineno} `{_code(lines, loop.lineno)}`"
        ran_out = len(set(sizes[1].values())) > 1 if sizes else not exits and isinstance(loop, ast.For)
        if ran_out:
            nb02, sec02 = _section("hang")
            counts = "" if not sizes else (f", whose data ran out first (`{sizes[0]}` has " + ", ".join(
                f"{n} batches on rank {q}" for q, n in sorted(sizes[1].items())) + ")")
            return Pattern("uneven", f"uneven inputs: rank {r}'s loop ran more steps than {who}'s{counts}",
                           at, nb02, sec02, None,
                           fix="give every rank the same number of batches (DistributedSampler, drop_last=True, "
                               "or shards of equal length), or run the loop inside DDP's Join context manager")
        line, code, how = exits[0] if exits else (loop.lineno, _code(lines, loop.lineno), "its `while` condition")
        same = "" if not sizes else (f", though its data had not run out (`{sizes[0]}` has {sizes[1][r]} "
                                     f"batches on every rank)")
        nb07, sec07 = _section("skipped")
        caught = "exception" in how
        return Pattern("left_loop", f"an early stop on one rank: {who} left the loop ({how}) while rank {r} "
                       f"ran on into the next step's collectives{same}", f"{_short(f.file)}:{line} `{code}`",
                       nb07, sec07, None, "whether a rank stops depends on its own data at run time",
                       fix="decide to stop on every rank together: each step, all-reduce a stop flag (flag = "
                           "torch.tensor(float(stop)); dist.all_reduce(flag, op=dist.ReduceOp.MAX)) and leave "
                           "the loop on every rank once it is set"
                           + ("; catch the exception inside the loop and set the flag, rather than leave the "
                              "loop on that rank alone" if caught else ""))
    return None


def _walk_loop_body(node):
    """Nodes inside node's body, not descending into nested loops or functions."""
    todo = list(ast.iter_child_nodes(node))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.For, ast.While, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(n))


def recognise(waiting: dict, others_elsewhere: bool, mismatch: bool, ranks: dict | None = None,
              inside: dict | None = None) -> Pattern | None:
    """waiting: {rank: user frames (outermost first)} of the ranks stuck in a collective; ranks:
    {rank: (user frames, {loader name: batches})} of every rank whose state is known; inside:
    {rank: user frames} of the ranks that waited for the others inside a loop (waiting, or failed
    only because they lost their peers), default the waiting ones."""
    nb07, sec07 = _section("skipped")
    for frames in waiting.values():
        if found := rank_condition(frames):
            f, line, code = found
            return Pattern("rank_condition", "a collective under a rank condition, which the other "
                           "ranks never call", f"{_short(f.file)}:{line} `{code}`", nb07, sec07, "DDP009",
                           flagged=_flags(f.file, "DDP009", range(line, f.line + 1)),
                           fix="call the collective on every rank: move it out of the `if`, and keep only "
                               "what rank 0 alone does (printing, saving) under it")
    for frames in waiting.values():
        if found := skip_in_loop(frames):
            f, line, code, nan = found
            words = ("a NaN skip on one rank: it skipped a step (and its collectives) the others ran"
                     if nan else "a skip on one rank: it left out a step (and its collectives) the others ran")
            return Pattern("skip", words, f"{_short(f.file)}:{line} `{code}`", nb07, sec07, None,
                           fix="decide the skip on every rank together: all-reduce the condition ("
                               + ("a NaN on any rank" if nan else "true on any rank")
                               + "), then every rank skips the step or none does")
    if others_elsewhere and (found := left_or_ran_out({**waiting, **(inside or {})}, ranks or {})):
        return found
    if mismatch:
        return Pattern("mismatch", "mismatched collectives: the ranks called different operations or "
                       "sizes at the same point", "the sites above", *MISMATCH_SECTION, None,
                       "which op and size each rank reaches is only known at run time",
                       fix="make every rank call the same collectives in the same order, with the same "
                           "shapes and dtypes")
    return None


def _flags(path: str, rule: str, lines) -> bool | None:
    """Does `ddp-lab check` report `rule` in path on one of these lines? None when it cannot say."""
    try:
        from ddp_lab.check import check_file
        return any(f.id == rule and f.line in lines for f in check_file(path))
    except Exception:  # noqa: BLE001
        return None


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1]
