"""scripts/slurm_ddp.sbatch on a real SLURM (ddp_lab.engine.slurm): munge, slurmctld and one slurmd
per node of the localhost cluster, started for this test and gone after it.

One SLURM, four jobs, as a user would submit them from the login node:
- a straight run, `sbatch --wait`: trains train_ddp.py to --max-steps, one torchrun per node;
- the same job cancelled (`scancel`) after its first checkpoint, then resubmitted: it resumes from
  that checkpoint and ends with the straight run's model, bit for bit;
- the same job with `--requeue`, and one of its nodes crashed: SLURM requeues it, and it resumes to
  the same model;
- the batch file with a probe in place of train_ddp.py, whose workers print their CPU affinity: each
  gets the job's 2 CPUs a node, and 1 where srun is not given --cpus-per-task (SLURM binds tasks by
  default here, as many sites do).
The link is shaped to 200 Mbit/s and the model is wide, so a step lasts at least the link's time
for its gradients (`wide_mlp`: 3.3 MB): the cancel lands long before the job could end.
Where SLURM cannot run (not installed, not root, no cluster), the tests say why and skip, except
under CI, which installs it (`.ci/run`).
"""
import os
import re
import time

import psutil
import pytest

from conftest import processes_with, wait_until
from ddp_lab.engine import launch, slurm

OK, WHY = slurm.available()
needs_slurm = pytest.mark.skipif(not OK and not os.environ.get("CI"), reason=WHY)
TRAIN = ["--model", "wide_mlp", "--hidden", "512", "--epochs", "4", "--max-steps", "24",
         "--save-every", "4", "--log-every", "2"]


def test_ci_has_slurm():
    if not os.environ.get("CI"):
        pytest.skip("outside CI a machine may lack SLURM: its cells then run the stand-in rehearsal")
    assert OK, WHY


def submit(s, out, ckpt, *sbatch_options, wait=False):
    """slurm_ddp.sbatch as its header says, on nodes of 1 stand-in GPU and 2 CPUs each."""
    return s.sbatch(["--gpus-per-node=1", "--cpus-per-task=2", f"--output={out}", *sbatch_options,
                     "scripts/slurm_ddp.sbatch", *TRAIN, "--ckpt-dir", ckpt], wait=wait)


@pytest.fixture(autouse=True)
def no_process_left_behind(request):
    """Replaces tests/conftest.py's check: the SLURM server (and its daemons) lives for the whole
    module, and `cluster` checks that it leaves nothing; each test may leave nothing else."""
    yield
    s = request.getfixturevalue("cluster")[0] if "cluster" in request.fixturenames else None
    me = psutil.Process()
    ours = {c.pid for c in psutil.Process(s.server.pid).children(recursive=True)} | {s.server.pid} if s else set()
    left = lambda: [c for c in me.children(recursive=True) if c.pid not in ours and c.status() != psutil.STATUS_ZOMBIE]
    assert wait_until(lambda: not left(), 15), left()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One localhost SLURM for the module's jobs, and the straight run every interrupted job must match."""
    if not OK and not os.environ.get("CI"):
        pytest.skip(WHY)
    tmp = tmp_path_factory.mktemp("slurm")
    with slurm.Slurm(nodes=2, link="200mbit") as s:
        straight = submit(s, tmp / "straight.out", tmp / "straight", wait=True)
        yield s, tmp, straight
        folder, server = s.dir, s.server.pid
    assert wait_until(lambda: not processes_with(str(folder)), timeout=10), processes_with(str(folder))
    assert wait_until(lambda: not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE, 10)
    assert not [p for p in processes_with("slurmd") if "ddp_lab_slurm_" in " ".join(p.cmdline())]
    assert not folder.exists(), f"the scratch folder (munge key, logs) was left behind: {folder}"


def sha_of(log: str) -> str:
    return re.search(r"params sha256 (\w+)", log).group(1)


def reached_checkpoint(ckpt):
    """The checkpoint itself, not the log: train_ddp.py prints "step 4" before it saves step 4, and a
    cancel landing between the two (seen under load) left nothing to resume from. last.pt appears by
    a rename after its write, so once it exists it is whole."""
    return lambda: (ckpt / "last.pt").exists()


def test_sbatch_trains_to_the_end_on_two_nodes(cluster):
    s, tmp, straight = cluster
    job = s.job(straight)
    log = (tmp / "straight.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, log[-2000:])
    assert job["NodeList"] == "node[0-1]" and job["NumNodes"] == "2"
    assert "world_size=2 " in log and "done: step 24" in log, log[-2000:]


def test_a_cancelled_job_resubmitted_resumes_to_the_straight_runs_model(cluster):
    s, tmp, straight = cluster
    out = tmp / "cancelled.out"
    first = submit(s, out, tmp / "ckpt")
    assert wait_until(reached_checkpoint(tmp / "ckpt"), 180), (s.job(first), out.read_text() if out.exists() else "no output")
    s.run(["scancel", first])
    assert wait_until(lambda: s.job(first)["JobState"] == "CANCELLED", 60), s.job(first)
    cut = max(int(m) for m in re.findall(r"^step (\d+) ", out.read_text(), re.M))
    assert cut < 24 and "done:" not in out.read_text()

    again = submit(s, tmp / "again.out", tmp / "ckpt", wait=True)
    log = (tmp / "again.out").read_text()
    assert s.job(again)["JobState"] == "COMPLETED", log[-2000:]
    resumed = int(re.search(r"resumed from \S+ at step (\d+)", log).group(1))
    assert 4 <= resumed <= cut and "done: step 24" in log
    assert sha_of(log) == sha_of((tmp / "straight.out").read_text())


def test_a_requeue_job_survives_a_crashed_node_and_resumes_to_the_same_model(cluster):
    """--requeue: node1 goes down as in a power cut (slurmd, the step, torchrun and its worker all
    killed). SLURM finds it not responding, sets it DOWN and requeues the job; once the node is
    back, the job runs again under the same id and resumes from its checkpoint."""
    s, tmp, straight = cluster
    out = tmp / "requeue.out"
    job = submit(s, out, tmp / "ckpt_rq", "--requeue")
    assert wait_until(reached_checkpoint(tmp / "ckpt_rq"), 180), (s.job(job), out.read_text() if out.exists() else "no output")
    assert len(s.crash(1)) >= 3                     # slurmd, slurmstepd, torchrun, its worker
    assert wait_until(lambda: "DOWN" in s.node("node1")["State"], 90), s.node("node1")
    assert s.job(job)["Restarts"] == "1"            # requeued, not failed
    s.boot(1)
    record = s.wait(job, 240)
    log = out.read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record, log[-2000:])
    assert int(re.search(r"resumed from \S+ at step (\d+)", log).group(1)) >= 4
    assert "done: step 24" in log and sha_of(log) == sha_of((tmp / "straight.out").read_text())


def test_every_worker_gets_the_jobs_cpus_and_one_where_srun_is_not_told(cluster):
    """Since SLURM 22.05 srun no longer takes --cpus-per-task from the batch job (sbatch(1)). The batch
    file passes it on; without it, where tasks are bound by default, the task (torchrun and every
    worker under it) is bound to 1 CPU. Debian's 22.05 here: measured, not assumed."""
    s, tmp, _ = cluster
    if s.unbound:
        pytest.skip(s.unbound)
    shipped = (launch.ROOT / "scripts" / "slurm_ddp.sbatch").read_text()
    flag = ' --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}"'
    assert flag in shipped and "scripts/train_ddp.py" in shipped
    probe = shipped.replace("scripts/train_ddp.py", "-m ddp_lab.experiments.nb10_cpus")
    counts = {}
    for name, text in (("shipped", probe), ("no_flag", probe.replace(flag, ""))):
        (tmp / f"{name}.sbatch").write_text(text)
        job = s.sbatch(["--gpus-per-node=2", "--cpus-per-task=2", f"--output={tmp}/{name}.out",
                        str(tmp / f"{name}.sbatch")], wait=True)
        log = (tmp / f"{name}.out").read_text()
        assert s.job(job)["JobState"] == "COMPLETED", log[-2000:]
        counts[name] = sorted((host, int(rank), int(n)) for host, rank, n in
                              re.findall(r"^(node\d) rank (\d+): (\d+) CPU", log, re.M))
    # 2 nodes x 2 workers, a line each (the rendezvous decides which node holds ranks 0-1)
    for name, seen in counts.items():
        assert [h for h, *_ in seen] == ["node0", "node0", "node1", "node1"], (name, seen)
        assert sorted(r for _, r, _ in seen) == [0, 1, 2, 3], (name, seen)
    assert [n for *_, n in counts["shipped"]] == [2, 2, 2, 2], counts
    assert [n for *_, n in counts["no_flag"]] == [1, 1, 1, 1], counts
