"""`ddp-lab verify --resume`: does the script resume from its own checkpoint exactly?

Three runs in the scratch folder, with the same arguments:
1. uninterrupted, to the end (or --steps): verify's main run; rank 0 notes, after each optimizer step, whether the
   script has written any file yet: the first step at which one exists is K (the step after the
   script's first checkpoint), unless --kill-at-step K is given;
2. again in a fresh folder, every rank SIGKILLed by itself right after optimizer step K (before
   the script can save again);
3. relaunched in that folder: the script finds its checkpoint and resumes.
The relaunched run's steps are then matched with the uninterrupted run's, each rank with its own:
its first step must equal the uninterrupted step it repeats, and every step after it too. Where one
differs, the state before that step on each rank says what was not restored, and on which rank:
the parameters, the optimizer state (momentum, Adam moments), the learning rate (the scheduler),
the batch drawn (the data position); when all of them agree, the global generators that start
every launch in the same state (dropout, augmentation: a random state saved by rank 0 alone and
loaded on every rank restores rank 0's stream only).
"""
from __future__ import annotations

from ddp_lab.verify.findings import Finding
from ddp_lab.verify.state import GENERATORS


def check(path, args, world, steps, kill_at, timeout, pg_timeout, scratch, report, full) -> list:
    """full: the records of the uninterrupted run (verify's main run, with DDP_LAB_VERIFY_FILES=1)."""
    from ddp_lab.verify.runner import launch_observed, steps_done
    folders = {n: (scratch / n / "records", scratch / n / "work") for n in ("killed", "resumed")}
    for records, work in folders.values():
        records.mkdir(parents=True)
        work.mkdir(exist_ok=True)
    folders["resumed"] = (folders["resumed"][0], folders["killed"][1])  # the killed run's files
    limit = {"DDP_LAB_VERIFY_STEPS": str(steps or 0)}
    a = _steps(full)
    k = kill_at or next((s for s, x in sorted(a.items()) if x.get("files")), None)
    if k is None:
        report.notes.append("resume: the script wrote no file during the run, so there is nothing to resume "
                            "from; give --kill-at-step K to kill it anyway")
        return []
    if k >= max(a, default=0):
        report.notes.append(f"resume: step {k} is the last step (or beyond it); nothing is left to resume")
        return []

    killed, e, wall = launch_observed(path, args, world, *folders["killed"], timeout, pg_timeout,
                                      {**limit, "DDP_LAB_VERIFY_KILL_AT": str(k)})
    report.runs.append({"ranks": world, "steps": steps_done(killed), "wall_s": round(wall, 2),
                        "what": f"killed at step {k}"})
    if steps_done(killed) < k:
        report.error = f"the run to be killed at step {k} stopped after step {steps_done(killed)}: {e or 'it ended'}"
        return []
    # The relaunch stops where the uninterrupted run stopped: after the steps it still owes.
    rest = {"DDP_LAB_VERIFY_STEPS": str(max(a) - (k - 1))} if steps else {}
    resumed, e, wall = launch_observed(path, args, world, *folders["resumed"], timeout, pg_timeout, rest)
    c = [x for x in resumed.get(0, []) if x.get("kind") == "step"]
    report.runs.append({"ranks": world, "steps": steps_done(resumed), "wall_s": round(wall, 2), "what": "resumed",
                        "from_step": _start(a, c)})  # the uninterrupted run's step its first step repeats
    if e is not None:
        report.error = f"the relaunch after the kill at step {k} failed: {str(e).strip()}"
        return []
    others = {r: (_steps(full, r), [x for x in resumed.get(r, []) if x.get("kind") == "step"])
              for r in sorted(full) if r != 0}
    # A generator the script never seeds (Python's, numpy's often) starts each launch elsewhere: only one
    # that the killed run's step 1 found as the uninterrupted run's did is compared after the resume.
    seeded = {r: {n for n, h in _steps(full, r).get(1, {}).get("rng_before", {}).items()
                  if _steps(killed, r).get(1, {}).get("rng_before", {}).get(n) == h} for r in full}
    found = compare(a, c, k, others, seeded)
    if not found:
        report.checked.append(f"resume-mismatch: killed after step {k} and relaunched; the relaunch's {len(c)} "
                              f"steps, from step {_start(a, c)}, bitwise equal to the uninterrupted run's on each "
                              f"of {1 + len(others)} ranks (each rank against its own uninterrupted steps)")
    return found


def _start(a: dict, c: list):
    """The uninterrupted run's step whose parameters the relaunch's first step reproduces (None: none)."""
    return next((n for n, x in sorted(a.items()) if x["params"] == c[0]["params"]), None) if c else None


def _steps(records, rank=0) -> dict:
    return {x["step"]: x for x in records.get(rank, []) if x.get("kind") == "step"}


def compare(a: dict, c: list, k: int, others: dict | None = None, seeded: dict | None = None) -> list:
    """a: rank 0's uninterrupted steps {n: record}; c: rank 0's relaunched steps, in order; k: the kill;
    others: {rank: (a, c)} of the other ranks, each compared with its own uninterrupted steps; seeded:
    {rank: the generators that start every launch in the same state} (None: all of them)."""
    ranks = {0: (a, c), **(others or {})}
    if not c:
        return [Finding("resume-mismatch", 0, k, "the relaunched run made no optimizer step",
                        f"the uninterrupted run made {max(a)} steps; the run killed at step {k} was relaunched",
                        "resume at the step after the checkpoint's, not at the end of training")]
    start = _start(a, c)
    if start == 1 and k > 1:
        return [Finding("resume-mismatch", 0, 1,
                        f"the relaunch did not resume: it trained from step 1 again, though the run killed "
                        f"after step {k} had written its files",
                        f"the relaunch's first step equals the uninterrupted run's step 1 (expected: step {k}, "
                        f"the one after the checkpoint); it made {len(c)} steps",
                        "load the checkpoint at start-up when it exists; if the script resumes only when asked "
                        "(its own flag, such as --resume), put that flag in ARGS after `--`: every launch, the "
                        "first one too, gets the same ARGS", c[0].get("at"))]
    if start is None:
        return [_differs(ranks, seeded, 0, k, 0, f"the first step after the resume (expected: step {k}, the one "
                                         f"after the checkpoint) equals no step of the uninterrupted run")]
    for i, x in enumerate(c):
        n = start + i
        if n not in a:
            return [Finding("resume-mismatch", 0, n, f"the resumed run goes on past step {max(a)}, where the "
                            f"uninterrupted run ended: it makes {start - 1 + len(c)} steps in all",
                            f"it resumed at step {start} and made {len(c)} steps",
                            "save the position in the data (epoch, batch) and resume from it", x.get("at"))]
        bad = [r for r, (ar, cr) in sorted(ranks.items())
               if i < len(cr) and n in ar and cr[i]["params"] != ar[n]["params"]]
        if bad:
            return [_differs(ranks, seeded, i, n, bad[0], f"step {n} after the resume differs from the uninterrupted "
                                                  f"run's")]
    if start - 1 + len(c) < max(a):
        return [Finding("resume-mismatch", 0, start + len(c),
                        f"the resumed run ends after step {start - 1 + len(c)}; the uninterrupted one after {max(a)}",
                        f"it resumed at step {start} and made {len(c)} steps",
                        "save the position in the data (epoch, batch) and resume from it", c[-1].get("at"))]
    return []


def _differs(ranks: dict, seeded: dict | None, i: int, step: int, rank: int, message: str) -> Finding:
    """What differed before the step on each rank: its i-th relaunched step against its uninterrupted `step`."""
    pairs = {r: (ar.get(step), cr[i]) for r, (ar, cr) in sorted(ranks.items()) if i < len(cr)}
    want, got = pairs[rank]
    if want is None:
        return Finding("resume-mismatch", rank, step, message, "-", "save and restore the whole training state",
                       got.get("at"))
    names = [n for n in want["params"] if got["params"].get(n) != want["params"][n]]
    causes, fixes, culprits = [], [], []
    for r, (w, g) in pairs.items():
        if w is None:
            continue
        found, fixed = _causes(w, g)
        culprits += [r] * bool(found)
        causes += [f"on rank {r}: {c}" if len(pairs) > 1 else c for c in found]
        fixes += [f for f in fixed if f not in fixes]
    if not causes:
        rng = {r: [GENERATORS[n] for n, h in w.get("rng_before", {}).items() if g["rng_before"].get(n) != h
                   and (seeded is None or n in seeded.get(r, ()))]
               for r, (w, g) in pairs.items() if w is not None and g.get("rng_before")}
        rng = {r: v for r, v in rng.items() if v}
        culprits += list(rng)
        if rng:
            causes += [f"on rank {r}: the random state before the step ({', '.join(v)})" for r, v in rng.items()]
            fixes.append("save and restore the RNG states (torch, numpy, random) of every rank, each its own"
                         + (": a state saved by rank 0 alone and loaded on every rank restores rank 0's stream only"
                            if 0 not in rng else ""))
        else:
            causes.append("nothing the step reads that is checked here: parameters, optimizer state, learning rate, "
                          "batch and the global generators agree on every rank, so something else the step uses "
                          "was not restored (a generator of the script's own?)")
            fixes.append("save and restore every rank's whole training state")
    if culprits and rank not in culprits:  # name the rank whose state was not restored
        rank = culprits[0]
        message += f"; what was not restored is rank {rank}'s"
    elif len(pairs) > 1 and rank != 0:
        message += f" on rank {rank}"
    return Finding("resume-mismatch", rank, step, message,
                   f"parameters differ: {', '.join(names[:3])}; what differed before the step: " + "; ".join(causes),
                   "; ".join(fixes), got.get("at"))


def _causes(want: dict, got: dict) -> tuple[list, list]:
    causes, fixes = [], []
    if got.get("pre_params") != want.get("pre_params"):
        causes.append("the parameters before the step (the model was not restored)")
        fixes.append("load the model's state_dict")
    if got.get("pre_opt") != want.get("pre_opt"):
        causes.append("the optimizer state before the step (momentum, Adam moments)")
        fixes.append("save and load optimizer.state_dict()")
    if got.get("lr") != want.get("lr"):
        causes.append(f"the learning rate: {got.get('lr')} after the resume, {want.get('lr')} uninterrupted "
                      f"(the scheduler)")
        fixes.append("save and load the scheduler's state_dict()")
    if got.get("batch") != want.get("batch"):
        causes.append(f"the batch: it starts {got.get('batch_head')} after the resume, {want.get('batch_head')} "
                      f"uninterrupted (the data position)")
        fixes.append("save the epoch and the batch within it; call set_epoch and skip the batches done")
    return causes, fixes
