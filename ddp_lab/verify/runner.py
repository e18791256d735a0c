"""Run a script on CPU ranks through ddp_lab.engine.launch with the observer armed, then compare.

The script runs unchanged, with its working directory in a scratch folder (whatever it writes
stays there). Every rank sees the variables of a node with one rank (the observer sets them before
the script starts), so LOCAL_RANK is 0 on every rank while RANK is not: a script that shards by
LOCAL_RANK shows it here, as it would on a cluster. One torchrun starts the ranks: a torchrun per
simulated node would cost a second agent's start and rendezvous for the same variables.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddp_lab.verify.findings import LIMITS, Finding, analyse, checked

INJECT = Path(__file__).resolve().parent / "_inject"


class CannotRun(Exception):
    """The script cannot be run: the message says why and what to do."""


@dataclass
class Report:
    script: str
    findings: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    runs: list = field(default_factory=list)   # [{ranks, steps, wall_s, returncode}]
    checked: list = field(default_factory=list)  # what the checks compared, counted from the runs
    limits: list = field(default_factory=list)   # what they cannot rule out
    error: str | None = None                   # why the script could not run (exit status 2)
    wall_s: float = 0.0

    @property
    def status(self) -> int:
        return 2 if self.error else (1 if self.findings else 0)

    def to_dict(self) -> dict:
        return {"script": self.script, "status": self.status, "error": self.error, "wall_s": round(self.wall_s, 2),
                "runs": self.runs, "findings": [f.to_dict() for f in self.findings], "notes": self.notes,
                "checked": self.checked, "cannot_rule_out": self.limits}

    def text(self) -> str:
        lines = [f.text() for f in self.findings]
        if self.error:
            lines.append(f"cannot run {self.script}: {self.error}")
        lines += [f"note: {n}" for n in self.notes]
        if self.status == 0:  # a clean report says what it rests on
            lines += ["checked:"] * bool(self.checked) + [f"  - {c}" for c in self.checked]
            lines += ["cannot rule out:"] * bool(self.limits) + [f"  - {c}" for c in self.limits]
        runs = ", ".join(f"{r['ranks']} rank{'s' * (r['ranks'] != 1)} ({r['steps']} step{'s' * (r['steps'] != 1)}"
                         f"{', ' + r['what'] if 'what' in r else ''}"
                         f"{' at step ' + str(r['from_step']) if r.get('from_step') else ''})" for r in self.runs)
        cats = sorted({f.category for f in self.findings})
        said = f"{len(self.findings)} finding{'s' if len(self.findings) != 1 else ''}" + \
               (f" ({', '.join(cats)})" if cats else "")
        lines.append(f"ddp-lab verify: {said}; ran {runs or 'nothing'} in {self.wall_s:.1f} s")
        return "\n".join(lines)


def verify(script, args=(), nproc: int = 2, steps: int | None = None, uneven: bool = False,
           timeout: float = 300, pg_timeout: float = 30, keep: bool = False, resume: bool = False,
           kill_at: int | None = None, scaling: bool = False) -> Report:
    """Run `script` (a path) with `args` on nproc CPU ranks, and 3 more with uneven=True;
    resume=True: also kill it at a step and relaunch it (ddp_lab.verify.resume); scaling=True: also
    take step 1 on 1 rank and compare its gradient and learning rate (ddp_lab.verify.world)."""
    start = time.monotonic()
    path = Path(script).expanduser().resolve()
    report = Report(str(script))
    if not path.is_file():
        report.error = f"no such file: {script} (give the path of a Python training script)"
        return report
    worlds = [nproc] + ([3] if uneven and nproc != 3 else [])
    scratch = Path(tempfile.mkdtemp(prefix="ddp_lab_verify_"))
    try:
        for world in worlds:
            found, error, records = _one_run(path, list(args), world, steps, timeout, pg_timeout,
                                             scratch / f"world{world}", report, files=resume and world == nproc)
            if world == nproc:
                full = records
            known = {f.category for f in report.findings}
            report.findings += [f for f in found if f.category not in known]
            if error:
                report.error = error
                break
        if scaling and not report.error:
            if nproc == 1:
                report.notes.append("grad-scale: --scaling compares with 1 rank, and the main run has 1 rank; "
                                    "give --nproc 2 or more")
            else:
                from ddp_lab.verify import world as invariant
                found = invariant.reference(path, list(args), nproc, timeout, pg_timeout, scratch / "world1",
                                            report, full)
                known = {f.category for f in report.findings}
                report.findings += [f for f in found if f.category not in known]
        if resume and not report.error:
            from ddp_lab.verify import resume as resume_check
            report.findings += resume_check.check(path, list(args), nproc, steps, kill_at, timeout, pg_timeout,
                                                  scratch / "resume", report, full)
        report.limits = list(LIMITS) + [
            *([] if uneven else ["shards that break only when the world size does not divide the data set "
                                 "(--uneven runs 3 ranks too)"]),
            *([] if scaling and nproc > 1 else ["a loss scaled with the world size, the same on every rank (--scaling "
                                                "compares the gradient of step 1 with a 1-rank run's)"]),
            *([] if resume else ["a resume from the script's checkpoint that differs from the uninterrupted "
                                 "run (--resume)"])]
    finally:
        if keep:
            report.notes.append(f"scratch folder kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    report.wall_s = time.monotonic() - start
    return report


def launch_observed(path, args, world, records_dir, work, timeout, pg_timeout, extra_env=None):
    """One launch of the script with the observer armed: (records by rank, LaunchError or None, seconds)."""
    from ddp_lab.engine import launch
    # Each rank moves into `work` itself (the observer, at its start), so the script's own files land
    # in the scratch folder while this process's working directory, the caller's, never changes.
    env = {"DDP_LAB_VERIFY_DIR": str(records_dir), "DDP_LAB_VERIFY_PG_TIMEOUT": str(pg_timeout),
           "DDP_LAB_VERIFY_WORKDIR": str(work), "DDP_LAB_VERIFY_ONE_PER_NODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(INJECT), os.environ.get("PYTHONPATH")])),
           **(extra_env or {})}
    error = None
    t0 = time.monotonic()
    try:
        launch.torchrun(str(path), nproc=world, args=args, timeout=timeout, env=env, stream=False)
    except launch.LaunchError as e:
        error = e
    return _read(records_dir), error, time.monotonic() - t0


def steps_done(records) -> int:
    return max((x["step"] for recs in records.values() for x in recs if x.get("kind") == "step"), default=0)


def _one_run(path, args, world, steps, timeout, pg_timeout, folder, report, files=False):
    records_dir, work = folder / "records", folder / "work"
    records_dir.mkdir(parents=True)
    work.mkdir()
    first = not report.runs
    records, e, wall = launch_observed(path, args, world, records_dir, work, timeout, pg_timeout,
                                       {"DDP_LAB_VERIFY_STEPS": str(steps or 0),
                                        "DDP_LAB_VERIFY_FILES": "1" if files else "0"})
    findings, error = [], None
    report.checked += [c if first else f"with {world} ranks: {c}" for c in checked(records, world)]
    if e is None:
        stopped = any(x.get("kind") == "stopped" for recs in records.values() for x in recs)
        report.checked.append(f"{'' if first else f'with {world} ranks: '}hang: every rank ran "
                              f"{'to its stop after' if stopped else 'to the end of the script,'} "
                              f"{steps_done(records)} steps (the process-group timeout capped at {pg_timeout:g} s)")
    if e is not None:
        hang = _hang(e, records_dir, world)
        if hang:
            findings.append(hang)
        else:
            error = str(e).strip()
            if "No such file" in error:
                error += ("\n(the script runs with its working directory in a scratch folder: give the paths "
                          "it reads as absolute paths)")
    notes = []
    findings = analyse(records, world, notes) + findings
    report.notes += [n if first else f"{world} ranks: {n}" for n in notes]
    report.runs.append({"ranks": world, "steps": steps_done(records), "wall_s": round(wall, 2),
                        "returncode": (e.run.returncode if e.run else -1) if e else 0})
    for x in (x for recs in records.values() for x in recs if x.get("kind") == "observer-error"):
        report.notes.append(f"rank {x['rank']}: the observer failed in {x['where']}: {x['error']}")
    if not first:
        for f in findings:
            f.message = f"with {world} ranks: {f.message}"
    return findings, error, records


def _hang(e, records_dir, world) -> Finding | None:
    """The launcher's hang diagnosis as a finding, or None when the script failed another way."""
    d = getattr(e, "autopsy", None)
    timed_out = str(e).startswith("timed out")
    if d is not None and not timed_out and d.kind not in ("mismatch", "missing"):
        d = None  # the ranks agree on where they were: they failed, they did not hang
    if d is not None and not timed_out and d.kind == "missing" and _raised(d):
        d = None  # a rank died of an error of its own while the others waited for it: a failure
    if d is None and not timed_out:
        return None
    records = _read(records_dir)
    last = {r: max((x["step"] for x in recs if x.get("kind") == "step"), default=0) for r, recs in records.items()}
    rank = None
    if d is not None:
        # The rank that never reached the collective, else the lowest: "failed" is no help, since
        # a process-group timeout fails every waiting rank, in an order that depends on the load.
        odd = [r for r, s in sorted(d.ranks.items()) if s.state in ("elsewhere", "finished")]
        rank = odd[0] if odd else min(d.ranks, default=None)
        lines = d.message().splitlines()[1:]  # under the headline: the pattern, each rank's stack
        evidence = "\n    ".join(x.strip() for x in lines if not x.startswith("Known pattern"))
        fix = (d.pattern.sentence() if d.pattern else
               "make every rank run the same collectives in the same order (the same number of batches, "
               "no collective under a condition on the rank)")
        headline = d.headline
        where = getattr(d.ranks.get(rank), "where", None)  # the script's line that rank was at
        line = f"{where.file}:{where.line}" if hasattr(where, "file") else None
    else:
        headline, evidence = "the ranks stopped making progress", str(e).strip()
        fix = "see each rank's last output above; the hang autopsy (on unless DDP_LAB_AUTOPSY=0) says more"
        line = None
    step = last.get(rank, max(last.values(), default=0)) + 1
    return Finding("hang", rank, step, headline, evidence or "-", fix, line)


def _raised(d) -> bool:
    """A rank that never reached the collective failed with an exception of its own (a lost peer,
    a timeout, is what a hang leaves, not its cause)."""
    from ddp_lab.autopsy.evidence import is_secondary
    return any(s.state == "failed" and s.exception and not is_secondary(s.exception) for s in d.ranks.values())


def _read(folder) -> dict:
    out = {}
    for p in sorted(Path(folder).glob("rank*.jsonl")):
        recs = []
        for line in p.read_text(errors="replace").splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        out[int(p.stem[4:])] = recs
    return out
