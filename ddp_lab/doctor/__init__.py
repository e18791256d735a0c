"""`ddp-lab doctor` / `python -m ddp_lab.doctor`: the pre-flight checklist, run on this machine.

    python -m ddp_lab.doctor                 # a table: pass / warn / fail / skip, and the fix
    python -m ddp_lab.doctor --json          # the same for scripts (its fields and statuses: --help)
    python -m ddp_lab.doctor --nproc 4 --nnodes 2 --master-addr head --ckpt-dir runs/ckpt
    python -m ddp_lab.doctor --nnodes 2 --node-rank 1 --master-addr head   # on each node at once

Versions (Python, torch, CUDA), driver against the CUDA runtime, GPUs (count, model,
memory, alike), backends, a real 2-process all-reduce with its bandwidth (gloo; NCCL too
with two GPUs), the master port, hostname resolution, /dev/shm, the open-file limit, cores
against the planned processes, disk space for checkpoints, whose torchrun is on PATH, and,
with --node-rank on every node, a real all-reduce between the nodes through node 0's address.
Exit status 1 when a check fails, else 0. Takes about 5 s on an idle 2-core machine and far
longer on a busy one: importing torch, here and in the all-reduce's two fresh processes, is
nearly all of it (README.md states what was measured).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time

from ddp_lab.doctor.checks import ALL, FIELDS, STATUSES, Check

DESCRIPTION = "Check this machine before a DDP job: versions, GPUs, backends, a real all-reduce, ports, limits."
EPILOG = "\n".join([
    '--json prints {"checks": [CHECK, ...], "ok": false when a check failed}; each CHECK has',
    *(f"  {k:<7} {v}" for k, v in FIELDS.items()),
    "status:",
    *(f"  {k:<7} {v}" for k, v in STATUSES.items()),
    "exit status: 1 when a check fails, else 0 (warnings included). See docs/workshop.md."])
WIDTH = 100  # a terminal, a notebook cell
MARK = {"pass": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "--  "}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--nproc", type=int, default=2, help="processes planned on this machine (default 2)")
    p.add_argument("--nnodes", type=int, default=1, help="machines planned in the job (default 1)")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   help="rendezvous address (default $MASTER_ADDR or 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", 29500)),
                   help="rendezvous port (default $MASTER_PORT or 29500)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this node's number (0 at --master-addr): with it, run on every node at once, the "
                        "doctors all-reduce across the nodes and report the link's bandwidth")
    p.add_argument("--ckpt-dir", default=".", help="where checkpoints will go (default .)")
    p.add_argument("--min-free-gib", type=float, default=2.0, help="free disk wanted for checkpoints")
    p.add_argument("--skip-allreduce", action="store_true", help="do not start the 2-process all-reduce")


def plan(**overrides) -> argparse.Namespace:
    """The default arguments, with overrides: doctor.run_checks(doctor.plan(nproc=4))."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    for k, v in overrides.items():
        if not hasattr(args, k):
            raise TypeError(f"unknown doctor setting {k!r}")
        setattr(args, k, v)
    return args


def run_checks(args: argparse.Namespace | None = None) -> list[Check]:
    args = args or plan()
    out = []
    for check in ALL:
        if check.__name__ == "allreduce" and args.skip_allreduce:
            continue
        start = time.perf_counter()
        try:
            result = check(args)
        except Exception as e:  # a check that breaks is a finding, not a crash of the doctor
            result = Check(check.__name__, "fail", f"the check raised {type(e).__name__}: {e}", "report this")
        for r in result if isinstance(result, list) else [result]:
            r.data = {**(r.data or {}), "check_s": round(time.perf_counter() - start, 2)}
            out.append(r)
    return out


def report(checks: list[Check], out=None) -> None:
    out = out or sys.stdout
    indent = " " * 22
    for c in checks:
        print(textwrap.fill(f"{MARK[c.status]}  {c.name:<15} {c.detail}", WIDTH, subsequent_indent=indent), file=out)
        if c.fix and c.status in ("warn", "fail"):
            print(textwrap.fill(f"fix: {c.fix}", WIDTH, initial_indent=indent, subsequent_indent=indent + "     "),
                  file=out)
    counts = {s: sum(c.status == s for c in checks) for s in MARK}
    print(f"{counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed, "
          f"{counts['skip']} not applicable", file=out)


def run(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    checks = run_checks(args)
    if args.json:
        json.dump({"checks": [c.to_dict() for c in checks],
                   "ok": not any(c.status == "fail" for c in checks)}, out, indent=1)
        print(file=out)
    else:
        report(checks, out)
    return 1 if any(c.status == "fail" for c in checks) else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_lab.doctor", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))
