"""Which exercises pass: a small JSON file, ~/.ddp_lab/grades.json (DDP_LAB_GRADES overrides), and
grades.json.lock beside it, which lets two kernels that record at once take turns."""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

GRADES_ENV = "DDP_LAB_GRADES"


def path() -> Path:
    return Path(os.environ.get(GRADES_ENV) or Path.home() / ".ddp_lab" / "grades.json")


def load() -> dict:
    try:
        return json.loads(path().read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise RuntimeError(f"cannot read the grades file {path()} ({err}); delete it or point "
                           f"{GRADES_ENV} at another file") from None


def record(exercise, status) -> None:
    """Remember the latest verdict ("passed", "failed", "blocked", or True/False); a pass stays a pass
    when a later try fails. Two kernels recording at once (two notebooks open) take turns, so neither
    verdict is lost."""
    status = {True: "passed", False: "failed"}.get(status, status) if isinstance(status, bool) else status
    if status not in ("passed", "failed", "blocked"):
        raise ValueError(f"a verdict is passed, failed or blocked, not {status!r}")
    passed = status == "passed"
    target = path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _turn(target):
        grades = load()
        before = grades.get(exercise.id, {})
        grades[exercise.id] = {"notebook": exercise.notebook, "passed": bool(passed or before.get("passed")),
                               "last": status, "time": time.strftime("%Y-%m-%d %H:%M")}
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(grades, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, target)  # atomic: a reader sees the old file or the new one, whole


@contextlib.contextmanager
def _turn(target: Path):
    """An exclusive lock on a file beside target (where fcntl exists; elsewhere, no lock)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(target.with_name(f"{target.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def table() -> dict:
    """{notebook: {exercise id: "passed" | "tried" | "blocked" | "not attempted"}}, from the grades file.
    "blocked": the last try could not be judged on that machine (and none passed before)."""
    from ddp_lab.grade.core import REGISTRY
    grades = load()
    found: dict = {}
    for ex in sorted(REGISTRY.values(), key=lambda e: e.id):
        g = grades.get(ex.id)
        state = ("not attempted" if g is None else "passed" if g["passed"] else
                 "blocked" if g.get("last") == "blocked" else "tried")
        found.setdefault(ex.notebook, {})[ex.id] = state
    return found


def progress() -> None:
    """Print, per notebook, which exercises pass. Returns nothing, so a notebook cell ending in
    grade.progress() shows the table once (table() gives the same as a dict)."""
    for nb, states in table().items():
        done = sum(s == "passed" for s in states.values())
        marks = "  ".join(f"{i} {MARKS[s]}" for i, s in states.items())
        print(f"{nb:28s} {done}/{len(states)} passed   {marks}")
    print(f"(✓ passed, ✗ tried, ⊘ blocked: this machine cannot judge it, · not attempted; kept in {path()})")


MARKS = {"passed": "✓", "tried": "✗", "blocked": "⊘", "not attempted": "·"}
