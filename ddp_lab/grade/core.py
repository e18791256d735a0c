"""Grade an exercise: run the learner's answer where the lesson proves its claim, compare.

An Exercise says how to run an answer on each rank (`on_rank`, which returns plain
observations: lists, numbers, strings) and how to judge the observations of every rank
against a reference the grader computes itself (`judge`, which returns the problems, each
a sentence with the evidence and the likely fix). Exercises with nproc=0 run in the kernel.

Answers go to the ranks by value: cloudpickle when it is installed (a function defined in a
notebook cell travels with the globals it uses), else the function's source, which IPython
keeps for every cell, executed on the rank with torch, dist, nn and F imported.
"""
from __future__ import annotations

import dis
import inspect
import math
import pickle
import re
import sys
import textwrap
import traceback
from dataclasses import dataclass, field
from typing import Callable

REGISTRY: dict[str, "Exercise"] = {}
RANK_TIMEOUT_S = 10  # a collective no other rank joins fails after this long: a hang is a finding

# Tolerances come from the quantity compared, not from the dtype the answer chose. float32, torch's
# default, rounds each operation to 2**-24 (6e-8) of the numbers it works on, float64 to 1e-16; a
# value is held to its size (or to the size of the numbers it was computed from) times:
FEW_OPS = 1e-6   # a few float32 operations from exact: a ratio of counts, a formula, bytes
MANY_OPS = 1e-5  # sums and products over float32 tensors: gradients, an optimizer step, a ring's mean
# Both are far below the smallest difference a typical mistake makes on the grader's tasks (the
# tests check that every mistake still fails), so float32 and float64 answers pass alike.


def close(got, want, rtol: float = FEW_OPS, scale: float | None = None) -> bool:
    """Whether `got` equals `want` up to rounding: every element within rtol x scale, where scale is
    the largest |want| unless given (the size of the numbers a difference was computed from)."""
    import numpy as np
    try:
        got, want = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    except (TypeError, ValueError):
        return False
    if got.shape != want.shape:
        return False
    if scale is None:
        scale = float(np.abs(want).max()) if want.size else 0.0
    return bool(np.all(np.isfinite(got)) and np.all(np.abs(got - want) <= rtol * scale))


def within(rtol: float = FEW_OPS, what: str = "", of: str = "its size") -> str:
    """The tolerance, said in a finding, so a learner need not wonder whether float32 is to blame."""
    exponent = round(math.log10(rtol))
    said = f"1e{exponent}" if math.isclose(rtol, 10.0 ** exponent) else f"{rtol:g}"
    return f"({what + ': ' if what else ''}compared within {said} of {of}, which float32 and float64 both meet)"


@dataclass(frozen=True)
class Exercise:
    id: str            # "03.5": notebook 03, exercise 5
    notebook: str      # "03_ring_allreduce"
    title: str
    skills: str        # for the instructors' list in docs/exercises.md
    answer: str        # what the learner hands to grade.check
    nproc: int         # ranks of the grading launch; 0 grades in the kernel
    on_rank: Callable  # (answer, rank, world) -> dict of observations
    judge: Callable    # ({rank: observations}) -> list of problems, [] when it passes
    on_error: Callable = lambda error: None  # (error text) -> a hint, or None
    blocked: Callable = lambda: None  # () -> why this machine cannot judge the exercise, or None


class Blocked(str):
    """A judge's finding that is not a failure: this machine cannot judge the criterion (it needs
    CUDA, or more cores than ranks for a timing, or the timings were too noisy to tell), and why."""


def register(exercise: Exercise) -> Exercise:
    REGISTRY[exercise.id] = exercise
    return exercise


@dataclass
class Result:
    id: str
    passed: bool | None        # None: not attempted yet, or blocked
    problems: list = field(default_factory=list)
    title: str = ""
    shown_in: int | None = field(default=None, repr=False, compare=False)  # the cell that printed it
    blocked: str | None = None  # why this machine cannot judge it: neither passed nor failed
    kind: str = field(default="function", repr=False, compare=False)  # what the learner fills in

    @property
    def status(self) -> str:
        """"passed", "failed", "blocked" or "not attempted"."""
        if self.blocked:
            return "blocked"
        return "not attempted" if self.passed is None else "passed" if self.passed else "failed"

    def __str__(self) -> str:
        if self.blocked:
            return (f"{self.id} {self.title}: blocked on this machine, neither passed nor failed: "
                    f"{self.blocked}")
        if self.passed is None:
            return (f"{self.id} {self.title}: not attempted yet. Fill in the {self.kind} above and run "
                    f"this cell again.")
        if self.passed:
            return f"{self.id} {self.title}: passed."
        return "\n".join([f"{self.id} {self.title}: not yet."] + [f"  - {p}" for p in self.problems])

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))

    def _ipython_display_(self):
        """A notebook cell ending in grade.check(...) shows the verdict once: check printed it."""
        if self.shown_in is None or self.shown_in != cell_number():
            print(self)


def cell_number() -> int | None:
    """The number of the notebook cell (IPython input) running now; None outside IPython."""
    ip = sys.modules.get("IPython")
    shell = ip.get_ipython() if ip is not None else None
    return getattr(shell, "execution_count", None)


def is_stub(answer) -> bool:
    """True for None, a function whose body is only a docstring and `...`/`pass`, or a class whose
    every method is such a function."""
    if answer is None:
        return True
    if isinstance(answer, (tuple, list)):
        return any(is_stub(a) for a in answer)
    if isinstance(answer, type):
        methods = [inspect.unwrap(f) for f in vars(answer).values() if inspect.isfunction(f)]
        return bool(methods) and all(is_stub(f) for f in methods)
    code = getattr(answer, "__code__", None)
    if code is None:
        return False
    ops = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname not in ("RESUME", "NOP")]
    return ops in ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])


def _by_value(obj) -> None:
    """Make cloudpickle copy the module that defined `obj` (a test fixture, a learner's file)."""
    import cloudpickle
    for f in obj if isinstance(obj, (tuple, list)) else (obj,):
        name = getattr(f, "__module__", None) or "__main__"
        mod = sys.modules.get(name)
        if name != "__main__" and mod is not None and not name.startswith(("ddp_lab", "torch")) \
                and getattr(mod, "__file__", None):
            cloudpickle.register_pickle_by_value(mod)


def pack(answer) -> bytes:
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(("source", _sources(answer)))
    _by_value(answer)
    return pickle.dumps(("pickle", cloudpickle.dumps(answer)))


def _sources(answer):
    if isinstance(answer, (tuple, list)):
        return [_sources(a) for a in answer]
    if not callable(answer):
        return ("value", answer)
    return ("def", answer.__name__, textwrap.dedent(inspect.getsource(answer)))


def unpack(blob: bytes):
    how, payload = pickle.loads(blob)
    if how == "pickle":
        return pickle.loads(payload)
    return _from_source(payload)


def _from_source(item):
    if isinstance(item, list):
        return tuple(_from_source(i) for i in item)
    if item[0] == "value":
        return item[1]
    import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F  # noqa: E401
    namespace = {"torch": torch, "dist": dist, "nn": nn, "F": F}
    exec(compile(item[2], f"<answer {item[1]}>", "exec"), namespace)
    return namespace[item[1]]


def as_given(x):
    """The learner's number as they gave it: an int stays an int, a float a float (a numpy or
    torch scalar becomes its Python value), so feedback echoes 66, not 66.0."""
    x = x.item() if hasattr(x, "item") else x
    return x if isinstance(x, (int, float)) else float(x)


def shown(values) -> str:
    """[66, 5.3]: the learner's numbers, ints as ints and floats to one decimal."""
    return "[" + ", ".join(str(v) if isinstance(v, int) else str(round(v, 1)) for v in values) + "]"


def error_text(exc: BaseException) -> str:
    """One line: the error and the last line of the answer's own code it came from."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "ddp_lab" not in f.filename and "torch" not in f.filename]
    where = f" (at `{frames[-1].line}`)" if frames and frames[-1].line else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {clean(first)}{where}"


def clean(message: str) -> str:
    """gloo's message without its source path and its boilerplate advice."""
    message = re.sub(r"\[(enforce fail at )?[^\]]*\.(cc|cpp|h):\d+\] ", "", message)
    return message.split(". This is typically")[0].split(" Is there a distributed")[0][:300]


CONSEQUENCE = ("connection closed", "connection reset", "read error", "broken pipe")


def _consequence(error: str) -> bool:
    return any(c in error.lower() for c in CONSEQUENCE)


def judge(exercise: Exercise, per_rank: dict) -> list:
    """Problems of one graded answer: the errors first, else what the exercise's judge finds."""
    launch_failure = per_rank.pop("launch", None)
    errors = {r: o["error"] for r, o in per_rank.items() if "error" in o}
    missing = [r for r in range(max(exercise.nproc, 1)) if r not in per_rank]
    if errors or missing:
        causes = {r: e for r, e in errors.items() if not _consequence(e)}
        shown = causes if (causes or missing) else errors
        problems = [f"rank {r} raised {e}" for r, e in sorted(shown.items())]
        if missing:
            problems.append(f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} died without "
                            f"a Python error: {clean(launch_failure or 'no record')}")
        lost = sorted(set(errors) - set(shown))
        if lost:
            problems.append(f"rank{'s' * (len(lost) > 1)} {', '.join(map(str, lost))} lost the connection: "
                            f"a consequence of the failure above")
        hints = {h for h in map(exercise.on_error, [*errors.values(), launch_failure or ""]) if h}
        if any("timed out" in e.lower() for e in errors.values()):
            hints.add(f"a rank waited {RANK_TIMEOUT_S} s for a message or collective that no other rank "
                      f"sent or joined: every rank must make the same calls, in the same order")
        return merge_ranks(problems, max(exercise.nproc, 1)) + sorted(hints)
    found = exercise.judge(per_rank)
    blocked = list(dict.fromkeys(p for p in found if isinstance(p, Blocked)))  # kept as Blocked, once
    return merge_ranks([p for p in found if not isinstance(p, Blocked)], max(exercise.nproc, 1)) + blocked


def merge_ranks(problems: list, world: int) -> list:
    """"rank 0 did X", "rank 1 did X" -> "every rank did X": one line per distinct finding."""
    groups: dict = {}
    for p in problems:
        m = re.search(r"\brank (\d+)", p)
        key = p if m is None else p[:m.start()] + "rank {}" + p[m.end():]
        groups.setdefault(key, []).append(m and int(m.group(1)))
    lines = []
    for key, ranks in groups.items():
        if ranks == [None]:
            lines.append(key)
            continue
        if len(ranks) == 1:
            lines.append(key.replace("rank {}", f"rank {ranks[0]}", 1))
            continue
        who = "every rank" if len(ranks) == world else "ranks " + ", ".join(map(str, ranks))
        lines.append(key.replace("rank {}'s", f"{who}'s" if len(ranks) < world else "every rank's")
                     .replace("rank {}", who))
    return lines
