"""`ddp-lab verify [options] -- SCRIPT [ARGS...]`: run your script on CPU ranks, check it is DDP-correct."""
from __future__ import annotations

import json

DESCRIPTION = """\
Run a training script unchanged on CPU ranks (gloo), observe each rank from inside (through
the environment: nothing in the script is edited) and compare the ranks:
  data-coverage       per pass, the ranks' shards are disjoint and cover the data set, and the
                      order changes between epochs (DistributedSampler + set_epoch)
  replica-divergence  after every optimizer step, parameters (and buffers DDP does not
                      re-broadcast) are bitwise equal on every rank
  rank-state          state kept outside the optimizer (an EMA of the weights, a teacher) is
                      equal on every rank after each of the first steps
  comm-per-step       one gradient all-reduce per optimizer step (accumulation uses no_sync)
  lr-per-step         each LR scheduler steps at most once per optimizer step
  eval-count          an all-reduced evaluation count does not include DistributedSampler's padding
  same-noise          the ranks' augmentation, dropout and noise drawn in the training loop differ
                      (the generators they draw from are not seeded alike)
  grad-scale          (--scaling) step 1's gradient on rank 0 equals a 1-rank run's on the same batch
  hang                a rank stopped making progress: the hang autopsy's diagnosis
  resume-mismatch     (--resume) killed at a step and relaunched, the script resumes from its
                      own checkpoint to the same parameters as an uninterrupted run, on every
                      rank (every launch gets the same ARGS: a resume flag of the script's own
                      goes after --)
Each finding names the script's line where it shows; a clean report lists what was checked and
what these checks cannot rule out.
The script runs with its working directory in a scratch folder; relative paths in ARGS are
read from there."""

EPILOG = """\
examples:
  ddp-lab verify -- train.py --epochs 1
  ddp-lab verify --steps 3 --uneven --json -- train.py

exit status: 0 no findings, 1 findings, 2 the script cannot be run (the reason is printed)"""


def add_arguments(p) -> None:
    p.add_argument("script", metavar="SCRIPT", help="the training script (a .py file)")
    p.add_argument("args", nargs="*", metavar="ARGS", help="its arguments (after --)")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the main run (default 2)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="stop every rank after N optimizer steps (default: run to the end)")
    p.add_argument("--uneven", action="store_true", help="also run on 3 ranks, to expose uneven shards")
    p.add_argument("--timeout", type=float, default=300, help="seconds for each run before it counts as a hang")
    p.add_argument("--pg-timeout", type=float, default=30,
                   help="cap on the script's process-group timeout, seconds (a hang fails fast)")
    p.add_argument("--scaling", action="store_true",
                   help="also take step 1 on 1 rank, on rank 0's batches, and compare the gradient (1 more launch)")
    p.add_argument("--resume", action="store_true",
                   help="also run it to the end, kill every rank at a step, relaunch, compare (3 more launches)")
    p.add_argument("--kill-at-step", type=int, default=None, metavar="K",
                   help="with --resume: the step to kill at (default: the one after the first file it wrote)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder and say where it is")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    for name in ("nproc", "steps", "kill_at_step"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"ddp-lab verify: --{name.replace('_', '-')} must be at least 1 (got {value})")
            return 2
    report = report_for(args)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return report.status


def report_for(args):
    """The Report of one verify, from the parsed command line (no output)."""
    from ddp_lab.verify.runner import verify
    return verify(args.script, args.args, nproc=args.nproc, steps=args.steps, uneven=args.uneven,
                  timeout=args.timeout, pg_timeout=args.pg_timeout, keep=args.keep, resume=args.resume,
                  kill_at=args.kill_at_step, scaling=getattr(args, "scaling", False))
