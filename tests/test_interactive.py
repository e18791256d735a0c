"""Interactive ranks: one live process group, and nothing left running however they end."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from conftest import wait_until

pytest.importorskip("ipyparallel", reason="interactive ranks need ipyparallel")
from ddp_lab import interactive  # noqa: E402


def with_env(value: str, skip=()) -> list:
    """Processes whose environment holds `value`: every process a start() made inherits it."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid not in skip and p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE \
                    and value in p.environ().values():
                found.append(p)
        except psutil.Error:
            pass
    return found


def _gone(pids) -> bool:
    return not [p for p in pids if psutil.pid_exists(p) and _running(p)]


def _cmd(p) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _running(pid) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_ranks_share_one_process_group_and_stop_ends_every_engine():
    ranks = interactive.start(nproc=2, magics=False)
    try:
        pids = ranks.pids
        assert len(set(pids)) == 2 and os.getpid() not in pids
        family = {p.pid for p in with_env(ranks.cluster_id)}
        assert set(pids) < family  # guardian, cluster, controller, engines and their nannies
        assert ranks.gather("rank") == [0, 1]
        assert ranks.gather("dist.get_world_size()") == [2, 2]
        assert ranks.gather("dist.get_backend()") == ["gloo", "gloo"]
        ranks.run("t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])")
        summed = ranks.collective("all_reduce", "t")
        assert [t.tolist() for t in summed] == [[3.0, 30.0], [3.0, 30.0]]
        ranks.run("t = torch.full((2,), float(rank))")
        assert [t.tolist() for t in ranks.collective("broadcast", "t", src=1)] == [[1.0, 1.0]] * 2
        printed = ranks.run("print('I am rank', rank)")
        assert printed.rows["printed"] == ["I am rank 0", "I am rank 1"]
        table = repr(ranks.side_by_side("rank * 7"))
        assert "rank 0" in table and "rank 1" in table and "| 7" in table
        with pytest.raises(interactive.RanksError, match=r"^rank 1: ZeroDivisionError"):
            ranks.run("x = 1.0 if rank == 0 else 1 / 0")
    finally:
        ranks.stop()
    assert wait_until(lambda: _gone(pids), timeout=10), pids
    assert not with_env(ranks.cluster_id)
    assert not Path(ranks.profile_dir).exists()
    with pytest.raises(interactive.RanksError, match="stopped"):
        ranks.gather("rank")
    ranks.stop()  # twice is fine


def test_engines_that_cannot_start_are_a_clear_error():
    with pytest.raises(interactive.RanksError, match="could not start") as info:
        interactive.start(nproc=2, python="/nonexistent/python", magics=False)
    assert "/nonexistent/python" in str(info.value)
    # conftest's autouse fixture checks that no child of this test process is left running


# A stand-in notebook kernel: it runs `body` with `ranks` and writes its progress to files.
KERNEL = """
import json, os, signal, sys, time
from ddp_lab import interactive
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a Jupyter kernel does
here = sys.argv[1]
def note(name, value=""):
    with open(os.path.join(here, name + ".tmp"), "w") as f:
        f.write(json.dumps(value))
    os.replace(os.path.join(here, name + ".tmp"), os.path.join(here, name))
"""


def _kernel(tmp_path, marker, body):
    """Run the stand-in kernel in a session of its own; every process it starts inherits `marker`."""
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL + textwrap.dedent(body))
    env = {**os.environ, "TEST_MARKER": marker}
    return subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _read(tmp_path, name, timeout=240):
    path = tmp_path / name
    assert wait_until(path.exists, timeout=timeout), f"{name} never written"
    import json
    return json.loads(path.read_text())


def test_killed_kernel_leaves_no_process_behind(tmp_path, marker):
    kernel = _kernel(tmp_path, marker, """
        ranks = interactive.start(nproc=2)
        note("pids", ranks.pids)
        time.sleep(600)
    """)
    try:
        pids = _read(tmp_path, "pids")
        assert len(with_env(marker, skip={kernel.pid})) >= 5  # guardian, cluster, controller, engines
        kernel.kill()  # SIGKILL, as a kernel restart may: the kernel cleans up nothing
        kernel.wait()
        assert wait_until(lambda: _gone(pids), timeout=30), pids
        assert wait_until(lambda: not with_env(marker, skip={kernel.pid}), timeout=30), \
            with_env(marker, skip={kernel.pid})
    finally:
        kernel.kill()
        kernel.wait()


def test_interrupt_while_starting_stops_every_engine(tmp_path, marker):
    kernel = _kernel(tmp_path, marker, """
        try:
            interactive.start(nproc=2)
        except KeyboardInterrupt:
            note("interrupted")
            time.sleep(600)  # the kernel lives on; the engines must not
    """)
    try:
        def engines():
            return [p for p in with_env(marker, skip={kernel.pid}) if _cmd(p).endswith("ipyparallel.engine")]
        assert wait_until(lambda: len(engines()) >= 2, timeout=240), "engines never started"
        os.killpg(kernel.pid, signal.SIGINT)  # the stop button signals the kernel's process group
        _read(tmp_path, "interrupted", timeout=60)
        assert wait_until(lambda: not with_env(marker, skip={kernel.pid}), timeout=30), \
            with_env(marker, skip={kernel.pid})
        assert kernel.poll() is None  # the kernel itself is still alive
    finally:
        kernel.kill()
        kernel.wait()


def test_interrupt_stops_the_ranks_work_and_keeps_the_ranks(tmp_path, marker):
    busy = tmp_path / "busy"
    kernel = _kernel(tmp_path, marker, f"""
        ranks = interactive.start(nproc=2)
        note("pids", ranks.pids)
        try:
            ranks.run("import time; open({str(busy)!r} + str(rank), 'w').close(); time.sleep(600)")
        except KeyboardInterrupt as stopped:
            note("shown", stopped._render_traceback_())  # what a notebook shows instead of a traceback
            note("after", ranks.gather("rank + 10"))
        ranks.stop()
    """)
    try:
        pids = _read(tmp_path, "pids")
        assert wait_until(lambda: all(Path(f"{busy}{r}").exists() for r in (0, 1)), timeout=120)
        os.killpg(kernel.pid, signal.SIGINT)
        assert _read(tmp_path, "after", timeout=60) == [10, 11]  # the same ranks answer at once
        (shown,) = _read(tmp_path, "shown")                      # one line, not ~40 of ipyparallel
        assert shown.startswith("RanksInterrupted: the ranks stopped"), shown
        assert kernel.wait(timeout=60) == 0, kernel.stdout.read()
        assert "[ranks] interrupted" in kernel.stdout.read()
        assert wait_until(lambda: _gone(pids), timeout=30), pids
        assert not with_env(marker, skip={kernel.pid})
    finally:
        kernel.kill()
        kernel.wait()


@pytest.mark.parametrize("nproc,gpus,expected", [(2, 0, "gloo"), (2, 1, "gloo"), (2, 2, "nccl"), (1, 1, "nccl")])
def test_ranks_pick_the_backend_by_the_launchers_rule(monkeypatch, nproc, gpus, expected):
    import torch
    monkeypatch.delenv("DDP_LAB_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert interactive._pick_backend(nproc, None) == expected
    monkeypatch.setenv("DDP_LAB_BACKEND", "gloo")  # the launcher's override holds for the ranks too
    assert interactive._pick_backend(nproc, None) == "gloo"
