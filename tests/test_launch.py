"""The launcher: results come back, failures explain themselves, nothing is left running."""
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from conftest import PROGRAMS, processes_with, wait_until
from ddp_lab.engine import launch


def test_first_launch_collects_records_from_every_rank():
    run = launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=2, stream=False)
    assert run.returncode == 0
    who = run.select(kind="whoami")
    assert sorted(r["RANK"] for r in who) == [0, 1]
    assert {r["WORLD_SIZE"] for r in who} == {2}
    assert {r["backend"] for r in who} == {"gloo"}
    assert len({r["pid"] for r in who}) == 2  # two real processes
    assert [r["value"] for r in run.select(kind="all_reduce")] == [1.0, 1.0]  # 0 + 1 on both
    # Output comes back tagged with the rank that printed it.
    assert any("all_reduce(rank ids) = 1" in line for line in run.rank_lines[0])


def test_live_output_is_prefixed_by_rank(capsys):
    launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=2)
    out = capsys.readouterr().out.splitlines()
    mine = [line for line in out if "pid" in line]
    assert sorted(line.split("]")[0] for line in mine) == ["[rank 0", "[rank 1"]
    assert all(line.startswith("[rank ") for line in mine)


def test_failure_message_is_the_failing_ranks_own_exception():
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(PROGRAMS / "fail_rank.py", nproc=2, stream=False, env={"DDP_LAB_TIMEOUT": "20"})
    message = str(info.value)
    assert message.startswith("rank 1 failed: ValueError: shard 7 is corrupt")
    assert "ChildFailedError" not in message and "elastic" not in message
    assert info.value.rank == 1
    assert "ChildFailedError" in info.value.run.log  # torchrun's banner is kept, not shown


def test_a_rank_killed_by_a_signal_is_named():
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(PROGRAMS / "killed.py", nproc=2, stream=False, timeout=120)
    assert "rank 1 was killed by SIGKILL" in str(info.value)


def test_missing_program_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no such program"):
        launch.torchrun("does_not_exist.py")


# The launcher's timeout killing every process is tested in test_autopsy.py
# (test_launcher_timeout_kills_every_process), in the shared launch of slow hangs there.


def _start_kernel(marker, env=None):
    """A stand-in notebook kernel running a launch of sleeping workers."""
    kernel = subprocess.Popen([sys.executable, str(PROGRAMS / "drive_launch.py"),
                               str(PROGRAMS / "sleeper.py"), marker],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    up = wait_until(lambda: Path(marker + ".ready").exists(), timeout=120)
    assert up, "workers never started"
    assert len(processes_with(marker)) >= 2  # both ranks are running now
    return kernel


def test_interrupt_stops_every_process(marker):
    kernel = _start_kernel(marker)
    kernel.send_signal(signal.SIGINT)  # what Jupyter's stop button does
    try:
        assert kernel.wait(timeout=30) == 130  # KeyboardInterrupt re-raised to the cell
    finally:
        kernel.kill()
    assert wait_until(lambda: not processes_with(marker), timeout=10), processes_with(marker)


def test_killed_kernel_leaves_no_process_behind(marker, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    kernel = _start_kernel(marker, env={**os.environ, "TMPDIR": str(tmp)})
    assert _launch_folders(tmp), "the launch made no folder of its own in TMPDIR"
    kernel.kill()  # SIGKILL, as "restart kernel" does: the kernel runs no cleanup at all
    kernel.wait()
    assert wait_until(lambda: not processes_with(marker), timeout=20), processes_with(marker)
    # nor a folder: the guardian removes the launch's records and torchrun's logs
    assert wait_until(lambda: not _launch_folders(tmp), timeout=20), _launch_folders(tmp)


def _launch_folders(tmp: Path) -> list:
    """What launches leave in the temp dir: theirs (ddp_lab_*), torchrun's (torchelastic_*)."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(("ddp_lab_", "torchelastic_")))


def test_a_launch_leaves_no_folder_in_the_temp_dir(tmp_path, monkeypatch):
    """torchrun keeps its per-rank logs in a torchelastic_* folder of the temp dir that it never
    removes: dozens of them after an afternoon of notebooks, unless the launch gives it its own."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    monkeypatch.delenv("PET_LOG_DIR", raising=False)
    run = launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=2, stream=False)
    assert sorted(r["RANK"] for r in run.select(kind="whoami")) == [0, 1], run.records
    assert _launch_folders(tmp) == []
    with pytest.raises(launch.LaunchError, match="shard 7 is corrupt") as info:
        launch.torchrun(PROGRAMS / "fail_rank.py", nproc=2, stream=False, env={"DDP_LAB_TIMEOUT": "20"})
    # a failure keeps only the autopsy's evidence, in the folder its message names
    assert all(f"{tmp}/{name}" in str(info.value) for name in _launch_folders(tmp)), _launch_folders(tmp)
    assert not [n for n in _launch_folders(tmp) if not n.startswith("ddp_lab_autopsy_")], _launch_folders(tmp)
    # torchrun's logs are kept where the learner asks for them (its --log-dir, PET_LOG_DIR)
    launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=1, stream=False,
                    env={"PET_LOG_DIR": str(tmp_path / "logs")})
    assert list((tmp_path / "logs").glob("*/attempt_0/0/stdout.log")), list((tmp_path / "logs").rglob("*"))
    assert not [n for n in _launch_folders(tmp) if not n.startswith("ddp_lab_autopsy_")], _launch_folders(tmp)


def test_two_launches_at_once_get_their_own_ports():
    runs, errors = [], []

    def go():
        try:
            runs.append(launch.torchrun(PROGRAMS / "env_report.py", nproc=2, stream=False))
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    ports = {r["master_port"] for run in runs for r in run.select(kind="env")}
    assert len(runs) == 2 and len(ports) == 2


def test_two_node_simulation_has_world_size_four():
    run = launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=2, nnodes=2, stream=False)
    who = run.select(kind="whoami")
    assert sorted(r["RANK"] for r in who) == [0, 1, 2, 3]
    assert {r["WORLD_SIZE"] for r in who} == {4}
    assert sorted((r["GROUP_RANK"], r["LOCAL_RANK"]) for r in who) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["value"] for r in run.select(kind="all_reduce")} == {6.0}


def test_max_restarts_is_passed_through():
    run = launch.torchrun(PROGRAMS / "crash_once.py", nproc=2, max_restarts=1, stream=False)
    assert sorted({r["attempt"] for r in run.select(kind="attempt")}) == [0, 1]
    with pytest.raises(launch.LaunchError):
        launch.torchrun(PROGRAMS / "crash_once.py", nproc=2, max_restarts=0, stream=False)


def test_threads_per_process_are_set_deliberately():
    run = launch.torchrun(PROGRAMS / "env_report.py", nproc=2, stream=False)
    expected = max(1, (os.cpu_count() or 1) // 2)
    assert {r["threads"] for r in run.select(kind="env")} == {expected}
    assert "Setting OMP_NUM_THREADS" not in run.log  # torchrun's banner does not appear
    run = launch.torchrun(PROGRAMS / "env_report.py", nproc=2, threads=1, stream=False)
    assert {r["threads"] for r in run.select(kind="env")} == {1}


def test_a_rank_that_exits_with_its_own_message_is_quoted(tmp_path):
    prog = tmp_path / "usage.py"
    prog.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    print('error: --batch-size must be at least 1', file=sys.stderr)\n"
        "else:  # as train_ddp.py does: the others wait, so rank 0's message is the first failure (two ranks\n"
        "    time.sleep(30)  # exiting at once is a race torchrun may record either way); torchrun stops them\n"
        "sys.exit(2)\n")
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(prog, nproc=2, stream=False)
    assert str(info.value) == "rank 0 exited with code 2: error: --batch-size must be at least 1"
