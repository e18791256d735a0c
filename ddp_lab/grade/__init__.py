"""Exercises that grade themselves, on real ranks where the lesson needs them.

    from ddp_lab import grade
    grade.check("03.5", ring_allreduce_mean)   # passed, or what differs and the likely fix
    grade.progress()                           # which exercises of which notebook pass

An answer that needs ranks runs in one short launch (ddp_lab.engine.launch, 2-3 processes) and is
compared with a reference the grader computes itself; the others run in the kernel.
Results are kept in ~/.ddp_lab/grades.json (DDP_LAB_GRADES names another file), except those of the
solution notebooks, whose worked answers are not the learner's.
"""
from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

from ddp_lab.grade import exercises  # noqa: F401  (registers every exercise)
from ddp_lab.grade.core import REGISTRY, Blocked, Result, cell_number, is_stub, judge, pack
from ddp_lab.grade.store import progress, record, table

__all__ = ["check", "check_many", "check_all", "progress", "table", "REGISTRY", "Result"]


def check(exercise_id: str, answer) -> Result:
    """Grade one answer, print the verdict in one block, remember it for progress()."""
    exercise = _exercise(exercise_id)
    if is_stub(answer):
        result = Result(exercise.id, None, title=exercise.title,
                        kind="class" if isinstance(answer, type) else "function")
    else:
        result = check_many(exercise_id, {"answer": answer})["answer"]
        if not in_solution_notebook():
            record(exercise, result.status)
    print(result)
    result.shown_in = cell_number()  # a cell that ends with this call does not show it again
    return result


def check_many(exercise_id: str, answers: dict) -> dict:
    """Grade several answers to one exercise in as few launches as possible: {label: Result}."""
    return check_all([(exercise_id, label, answer) for label, answer in answers.items()])


def check_all(items: list) -> dict:
    """Grade [(exercise id, label, answer), ...]: one launch per rank count, {label: Result}. An
    exercise this machine cannot judge (its `blocked` says why) is not run: its result is blocked."""
    exercises = {label: _exercise(eid) for eid, label, _ in items}
    labels = list(exercises)
    out = {label: Result(ex.id, None, title=ex.title, blocked=why)
           for label, ex in exercises.items() if (why := ex.blocked())}
    items = [item for item in items if item[1] not in out]
    seen: dict = {}
    for nproc in sorted({exercises[label].nproc for _, label, _ in items}):
        batch = [(eid, label, a) for eid, label, a in items if exercises[label].nproc == nproc]
        if nproc == 0:
            seen.update({label: _in_kernel(exercises[label], a) for _, label, a in batch})
        else:
            seen.update(_on_ranks(nproc, [(eid, label, pack(a)) for eid, label, a in batch]))
    for _, label, _ in items:
        ex = exercises[label]
        problems = judge(ex, seen[label])
        stops = [p for p in problems if not isinstance(p, Blocked)]
        why = "; ".join(p for p in problems if isinstance(p, Blocked)) or None
        out[label] = Result(ex.id, None if (why and not stops) else not stops, stops, ex.title,
                            blocked=None if stops else why)
    return {label: out[label] for label in labels}


def in_solution_notebook() -> bool:
    """Whether this kernel runs a solution notebook (Jupyter names a kernel's notebook in
    JPY_SESSION_NAME): its worked answers are not the learner's, so its verdicts are not kept."""
    return Path(os.environ.get("JPY_SESSION_NAME", "")).stem.endswith("_solutions")


def _exercise(exercise_id: str):
    if exercise_id not in REGISTRY:
        raise KeyError(f"no exercise {exercise_id!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[exercise_id]


def _in_kernel(exercise, answer) -> dict:
    from ddp_lab.grade.core import error_text
    try:
        return {0: exercise.on_rank(answer, 0, 1)}
    except Exception as exc:
        return {0: {"error": error_text(exc)}}


def _on_ranks(nproc: int, jobs: list) -> dict:
    """{label: {rank: observations}}; a launch that stopped after a failed job is resumed."""
    from ddp_lab.engine import launch
    done: dict = {}
    while jobs:
        results, failure = _launch(nproc, jobs, launch)
        complete = 0
        for _, label, _ in jobs:
            got = results.get(label, {})
            finished = len(got) == nproc
            if not finished and complete > 0:
                break  # maybe a consequence of the job before it: run it again in a fresh launch
            if not finished and failure:
                got = {**got, "launch": failure}
            done[label] = got
            complete += 1
            if not finished or any(isinstance(o, dict) and "error" in o for o in got.values()):
                break  # the ranks stop after a failed job
        jobs = jobs[complete:]
    return done


def _launch(nproc, jobs, launch) -> tuple:
    with tempfile.TemporaryDirectory(prefix="ddp_lab_grade_") as tmp:
        path = os.path.join(tmp, "jobs.pkl")
        with open(path, "wb") as f:
            pickle.dump(jobs, f)
        env = {"DDP_LAB_AUTOPSY": "0", "DDP_LAB_GRADE_TMP": tmp}
        failure = None
        try:
            run = launch.torchrun("-m ddp_lab.grade.ranks", nproc=nproc, args=[path],
                                  timeout=180, env=env, stream=False)
        except launch.LaunchError as err:  # a rank that died without a record: judged as missing
            if err.run is None:
                raise
            run, failure = err.run, str(err).strip().splitlines()[0][:300]
    results: dict = {}
    for r in run.select(kind="graded"):
        results.setdefault(r["job"], {})[r["rank"]] = r["obs"] if "obs" in r else {"error": r["error"]}
    return results, failure
