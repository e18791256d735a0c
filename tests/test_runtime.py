"""runtime: the same program runs unlaunched (world of one) and under torchrun."""
import json
import subprocess
import sys

from conftest import PROGRAMS
from ddp_lab import launch


def test_unlaunched_program_is_a_world_of_one(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "DDP_LAB_RECORDS": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "ddp_lab.experiments.hello"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rank 0/1" in out.stdout and "all_reduce(rank ids) = 0" in out.stdout
    records = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert records[0]["kind"] == "whoami" and records[0]["WORLD_SIZE"] == 1


def test_launched_program_sees_torchrun_world():
    run = launch.torchrun(PROGRAMS / "env_report.py", nproc=2, stream=False)
    env = run.select(kind="env")
    assert sorted(r["rank"] for r in env) == [0, 1]
    assert all(r["launched"] and r["world_size"] == 2 and r["backend"] == "gloo" for r in env)


def test_collective_timeout_fails_a_lost_rank_loudly(tmp_path):
    # Rank 0 waits at a barrier rank 1 never reaches: with a 3 s timeout it must fail, not hang.
    prog = tmp_path / "lost.py"
    prog.write_text(
        "import time, torch.distributed as dist\n"
        "from ddp_lab import runtime\n"
        "with runtime.distributed() as ctx:\n"
        "    if ctx.rank == 0:\n"
        "        dist.barrier()\n"
        "    else:\n"
        "        time.sleep(20)\n")
    try:
        launch.torchrun(prog, nproc=2, stream=False, timeout=120, env={"DDP_LAB_TIMEOUT": "3"})
    except launch.LaunchError as e:
        assert e.rank == 0
        assert "rank 0 failed" in str(e)
    else:
        raise AssertionError("a barrier with a missing rank must fail")
