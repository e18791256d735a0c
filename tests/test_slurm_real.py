"""scripts/slurm_ddp.sbatch on a real SLURM (ddp_lab.engine.slurm): munge, slurmctld and one slurmd
per node of the localhost cluster, started for this test and gone after it.

One SLURM, three jobs, as a user would submit them from the login node:
- a straight run, `sbatch --wait`: trains train_ddp.py to --max-steps, one torchrun per node;
- the same job cancelled (`scancel`) after its first checkpoint;
- resubmitted: it resumes from that checkpoint and ends with the straight run's model, bit for bit.
The link is shaped to 200 Mbit/s and the model is wide, so a step lasts at least the link's time
for its gradients (`wide_mlp`: 3.3 MB): the cancel lands long before the job could end.
Where SLURM cannot run (not installed, not root, no cluster), the tests say why and skip, except
under CI, which installs it (`.ci/run`).
"""
import os
import re
import time

import pytest

from conftest import processes_with, wait_until
from ddp_lab.engine import slurm

OK, WHY = slurm.available()
needs_slurm = pytest.mark.skipif(not OK and not os.environ.get("CI"), reason=WHY)
TRAIN = ["--model", "wide_mlp", "--hidden", "512", "--epochs", "4", "--max-steps", "24",
         "--save-every", "4", "--log-every", "2"]


def test_ci_has_slurm():
    if not os.environ.get("CI"):
        pytest.skip("outside CI a machine may lack SLURM: its cells then run the stand-in rehearsal")
    assert OK, WHY


def submit(s, out, ckpt, *extra, wait=False):
    """slurm_ddp.sbatch as its header says, on nodes of 1 stand-in GPU and 2 CPUs each."""
    return s.sbatch(["--gpus-per-node=1", "--cpus-per-task=2", f"--output={out}",
                     "scripts/slurm_ddp.sbatch", *TRAIN, "--ckpt-dir", ckpt, *extra], wait=wait)


@needs_slurm
def test_sbatch_trains_to_the_end_and_a_cancelled_job_resumes_to_the_same_model(tmp_path):
    with slurm.Slurm(nodes=2, link="200mbit") as s:
        straight = submit(s, tmp_path / "straight.out", tmp_path / "straight", wait=True)
        job = s.job(straight)
        log = (tmp_path / "straight.out").read_text()
        assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, log[-2000:])
        assert job["NodeList"] == "node[0-1]" and job["NumNodes"] == "2"
        assert "world_size=2 " in log and "done: step 24" in log, log[-2000:]
        sha = re.search(r"params sha256 (\w+)", log).group(1)

        out = tmp_path / "cancelled.out"
        first = submit(s, out, tmp_path / "ckpt")
        assert wait_until(lambda: out.exists() and re.search(r"^step (4|6|8) ", out.read_text(), re.M), 180), \
            (s.job(first), out.read_text() if out.exists() else "no output")
        s.run(["scancel", first])
        assert wait_until(lambda: s.job(first)["JobState"] == "CANCELLED", 60), s.job(first)
        cut = max(int(m) for m in re.findall(r"^step (\d+) ", out.read_text(), re.M))
        assert cut < 24 and "done:" not in out.read_text()

        again = submit(s, tmp_path / "again.out", tmp_path / "ckpt", wait=True)
        log = (tmp_path / "again.out").read_text()
        assert s.job(again)["JobState"] == "COMPLETED", log[-2000:]
        resumed = int(re.search(r"resumed from \S+ at step (\d+)", log).group(1))
        assert 4 <= resumed <= cut and "done: step 24" in log
        assert re.search(r"params sha256 (\w+)", log).group(1) == sha   # the straight run's model
        folder = s.dir
    assert wait_until(lambda: not processes_with(str(folder)), timeout=10), processes_with(str(folder))
    assert not [p for p in processes_with("slurmd") if "ddp_lab_slurm_" in " ".join(p.cmdline())]

