"""runtime: the same program runs unlaunched (world of one) and under torchrun."""
import json
import subprocess
import sys

import pytest

from conftest import PROGRAMS
from ddp_lab.engine import launch, runtime


def test_unlaunched_program_is_a_world_of_one(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "DDP_LAB_RECORDS": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "ddp_lab.experiments.nb00_hello"], env=env,
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
        "from ddp_lab.engine import runtime\n"
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


def test_a_late_rank_still_joins_under_a_short_collective_timeout(tmp_path):
    # On a busy machine one rank can take seconds longer to import torch: the collective timeout
    # (3 s here) must not turn that into a failed start. Rank 0 arrives 6 s after rank 1.
    prog = tmp_path / "late.py"
    prog.write_text(
        "import os, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    time.sleep(6)\n"
        "import torch, torch.distributed as dist\n"
        "from ddp_lab.engine import runtime\n"
        "with runtime.distributed() as ctx:\n"
        "    x = torch.ones(1)\n"
        "    dist.all_reduce(x)\n"
        "    ctx.record(kind='sum', value=x.item())\n")
    run = launch.torchrun(prog, nproc=2, stream=False, timeout=120, env={"DDP_LAB_TIMEOUT": "3"})
    assert sorted(r["value"] for r in run.select(kind="sum")) == [2.0, 2.0]


def _train_ddp_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_ddp_for_test", launch.script("train_ddp.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("processes,gpus", [(p, g) for p in (1, 2, 4) for g in (0, 1, 2, 4, 8)])
def test_script_and_runtime_pick_the_same_device(monkeypatch, processes, gpus):
    """NCCL needs a GPU per process: both fall back to gloo on the CPU with fewer GPUs."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    monkeypatch.delenv(runtime.BACKEND_ENV, raising=False)
    backend, device = runtime.pick_backend()
    assert (device, backend) == (("cuda", "nccl") if gpus >= processes else ("cpu", "gloo"))
    assert _train_ddp_module().pick_device("auto", "auto", processes, gpus) == (device, backend)


@pytest.mark.parametrize("processes,gpus", [(2, 1), (4, 2), (2, 0)])
def test_forcing_nccl_with_too_few_gpus_names_the_fix(monkeypatch, processes, gpus):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    monkeypatch.setenv(runtime.BACKEND_ENV, "nccl")
    with pytest.raises(RuntimeError, match="NCCL needs one GPU per process"):
        runtime.pick_backend()
    mod = _train_ddp_module()
    needle = f"{processes} processes on this node but {gpus} GPU" if gpus else "--backend nccl needs CUDA"
    with pytest.raises(mod.UsageError, match=needle):
        mod.pick_device("auto", "nccl", processes, gpus)
    if gpus:
        with pytest.raises(mod.UsageError, match=f"--nproc_per_node={gpus}"):
            mod.pick_device("cuda", "auto", processes, gpus)
