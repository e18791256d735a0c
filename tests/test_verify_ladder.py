"""`ddp-lab verify` passes every rung of the script ladder and every program of ddp_lab/experiments
that trains (a DDP model, an optimizer step over data): no finding, on 2 ranks, run to the end.

Each program runs with the smallest arguments that still train it as written (the digits rungs:
2 epochs of batch 256, so both epochs' orders are compared); one verify is one launch (2 ranks),
so the launch dominates the cost, not the steps, and the verifies run two at a time. A demo whose bug is the lesson runs in its correct
mode (nb02_uneven.py --fix join; with --fix none it hangs, which verify reports as the hang).

Out of scope, with the reason (each experiment is either in PROGRAMS or named here):
  nb00_hello.py          prints each rank's identity and sums the ranks: no model
  nb00_broken.py         raises on rank 1 before any collective, on purpose: no model
  nb01_ddp_checks.py     a probe of DDP's guarantees that breaks them on purpose in every launch
                         (a seed per rank, broadcast_buffers=False with BatchNorm); no correct mode
  nb02_loader.py         one process, no process group: DataLoader workers timed
  nb02_metrics.py        evaluation and per-step timing with a hand-made all-reduce: no optimizer step
  nb03_ring.py           a ring all-reduce from send/recv, checked against dist.all_reduce: no model
  nb03_link.py           all-reduces timed across the localhost cluster's shaped link: no model
  nb05_nosync.py         compares accumulation with and without no_sync: its article variants
                         all-reduce every micro-batch on purpose (verify finds them: comm-per-step)
  nb06_load_and_shard.py checkpoint loading and sharded saving: one optimizer step to fill its state,
                         no training over data
  nb06_what_to_save.py   one process, no process group
  nb06b_ladder.py        the rungs' own train(), one after the other in one launch: each rung file is
                         verified above on its own, main() included
  nb07_collectives.py    mismatched and skipped collectives, each caught in a group of its own
  nb07_ddp.py            DDP's failure cases, each caught in a group of its own (a step on rank 0
                         only, BatchNorm buffers, a NaN): broken on purpose, no correct mode
  nb07_debug_server.py   torch's debug server on a job that waits on purpose: no model
  nb07_hang.py           the lesson's hang (a loss all-reduced under `if rank == 0:`), always on:
                         verify reports it as a hang
  nb07_launch.py         rendezvous and identity failures: no training
  nb07_record.py         fails in a helper on purpose (torchrun's @record): no training
  nb08_profile.py        profiling and step timing
  nb08_link.py           steps timed across the localhost cluster's link, their replicas apart on
                         purpose (local SGD averages only every 4 steps); verify runs on loopback
  nb09_pairs.py          single Adam steps on rank 0 only, on purpose (what Horovod's broadcasts fix)
  nb09_parallel.py       tensor and pipeline parallelism: parameters split across ranks by design
  nb09_strategies.py     DDP beside ZeroRedundancyOptimizer and FSDP2, whose parameters and optimizer
                         state are sharded per rank by design (verify compares whole replicas)
  nb09b_parallelisms.py  tensor and pipeline parallelism by hand: split across ranks by design
  nb10_cpus.py           prints each worker's CPUs under the localhost SLURM: no training
  nb11_gpu_paths.py      DDP's options counted: grads read in comm hooks, graphs counted by a backend
                         of its own, FSDP2/HSDP shards per rank by design (verify compares whole replicas)
  nb12_naive.py          naive all-reduces beside torch's DDP on the same gradients: no optimizer step
"""
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ddp_lab.lessons import ladder
from ddp_lab.verify import verify

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "ddp_lab" / "experiments"
RUNG_ARGS = ("--epochs", "2", "--batch-size", "256")

# name -> (arguments, optimizer steps per rank). Relative paths land in verify's scratch folder.
PROGRAMS = {
    **{r.file: (RUNG_ARGS, 4 if r.file == "minimal_ddp.py" else 6) for r in ladder.RUNGS},
    "nb02_uneven.py": (("--fix", "join"), 8),  # 2 trainings of 4 steps: rank 0 joins after its 3rd
    "nb03_buckets.py": (("--steps", "1", "--epochs", "1", "--caps", "25", "--delays", "0"), 82),
    "nb05_lr_scaling.py": (("--epochs", "2", "--warmup-epochs", "1"), 96),
    "nb10_elastic.py": (("--ckpt", "elastic.pt", "--steps", "6", "--sample-ms", "0"), 6),
}


def _path(name: str) -> Path:
    return ROOT / "scripts" / name if (ROOT / "scripts" / name).exists() else EXPERIMENTS / name


def test_every_experiment_is_verified_or_said_out_of_scope():
    said = __doc__.split("Out of scope")[1]
    for p in sorted(EXPERIMENTS.glob("nb*.py")):
        assert (p.name in PROGRAMS) != (f"  {p.name} " in said), \
            f"{p.name}: add it to PROGRAMS, or to the docstring's list with the reason it does not train"


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every program verified once, two at a time, from a folder of its own: verify writes nothing
    in the caller's folder (relative paths land in its scratch folder)."""
    caller = tmp_path_factory.mktemp("caller")
    here = os.getcwd()
    os.chdir(caller)
    try:
        with ThreadPoolExecutor(2) as pool:
            done = dict(zip(PROGRAMS, pool.map(lambda n: verify(str(_path(n)), list(PROGRAMS[n][0])), PROGRAMS)))
    finally:
        os.chdir(here)
    return done, caller


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_verify_finds_nothing(name, reports):
    args, steps = PROGRAMS[name]
    report, caller = reports[0][name], reports[1]
    text = report.text()
    assert report.status == 0 and report.findings == [] and report.error is None, text
    assert report.notes == [], text  # e.g. "one pass seen": the run compared less than it should
    (run,) = report.runs
    assert (run["ranks"], run["returncode"], run["steps"]) == (2, 0, steps), text
    assert text.splitlines()[-1].startswith(f"ddp-lab verify: 0 findings; ran 2 ranks ({run['steps']} steps)")
    assert os.listdir(caller) == []
