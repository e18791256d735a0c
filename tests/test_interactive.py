"""Interactive ranks: one live process group, and nothing left running however they end."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from conftest import alive, listening, loopback, socket_inodes, wait_until

pytest.importorskip("ipyparallel", reason="interactive ranks need ipyparallel")
from ddp_lab.engine import interactive  # noqa: E402


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
    return not [p for p in pids if alive(p)]


def _cmd(p) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def test_ranks_share_one_process_group_and_stop_ends_every_engine():
    ranks = interactive.start(nproc=2, magics=False)
    try:
        pids = ranks.pids
        assert len(set(pids)) == 2 and os.getpid() not in pids
        family = {p.pid for p in with_env(ranks.cluster_id)}
        assert set(pids) < family  # guardian, cluster, controller, engines and their nannies
        # Nothing of theirs listens on the network: the controller, and rank 0's store, on loopback only
        theirs = set().union(*map(socket_inodes, family))
        listeners = {i: a for i, a in listening("/proc/net").items() if i in theirs}
        assert listeners, "no listener of the ranks found (the store, the controller)"
        exposed = {i: a for i, a in listeners.items() if not loopback(a[0])}
        assert not exposed, f"the live ranks listen on the machine's network: {exposed}"
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
from ddp_lab.engine import interactive
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
        assert "the ranks stopped" not in kernel.stdout.read()  # said once: by the exception
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


# --- %%px in a real kernel: each rank's error once, every line a rank printed ------------------
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Kernel:
    """A real IPython kernel driven as JupyterLab drives it: run a cell, read what it shows."""

    def __init__(self):
        from jupyter_client.manager import start_new_kernel
        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=str(interactive.ROOT))

    def submit(self, code: str) -> str:
        return self.client.execute(code)

    def shown(self, msg_id: str, timeout: float = 240) -> tuple:
        """(texts shown, error tracebacks) of the cell `msg_id`, once the kernel is idle again."""
        texts, errors = [], []
        while True:
            msg = self.client.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                return "\n".join(ANSI.sub("", t) for t in texts), errors
            if kind == "stream":
                texts.append(content["text"])
            elif kind in ("display_data", "update_display_data", "execute_result"):
                texts.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                errors.append([ANSI.sub("", line) for line in content["traceback"]])

    def run(self, code: str) -> tuple:
        return self.shown(self.submit(code))

    def close(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def px_cells(tmp_path_factory):
    """One kernel, one start of the ranks, the %%px cells below; ended before the tests look:
    {name: (text shown, error tracebacks)}."""
    busy = tmp_path_factory.mktemp("px") / "busy"
    kernel, shown = Kernel(), {}
    try:
        shown["start"] = kernel.run("from ddp_lab.engine import interactive\nranks = interactive.start(nproc=2)")
        shown["rank 1 fails"] = kernel.run('%%px\nprint("before", rank)\nx = 1.0 if rank == 0 else 1 / 0')
        shown["both fail"] = kernel.run("%%px\nraise ValueError(f'bad rank {rank}')")
        cell = kernel.submit(f'%%px\nimport time\nprint("before the stop", rank)\n'
                             f'open({str(busy)!r} + str(rank), "w").close()\ntime.sleep(600)')
        if wait_until(lambda: all(Path(f"{busy}{r}").exists() for r in (0, 1)), timeout=120):
            kernel.manager.interrupt_kernel()   # the stop button, as JupyterLab sends it
        shown["stopped"] = kernel.shown(cell)
        shown["after the stop"] = kernel.run("%%px\nprint('still here', rank)")
        kernel.run("ranks.stop()")
    finally:
        kernel.close()
    return shown


def test_px_error_shows_once_per_rank(px_cells):
    text, errors = px_cells["start"]
    assert not errors and "2 ranks up" in text, (text, errors)
    text, errors = px_cells["rank 1 fails"]
    assert "before 0" in text and "before 1" in text, text
    # rank 1's traceback, streamed once in plain form; nothing of it again in the cell's error
    assert text.count("Traceback") == 1 and text.count("ZeroDivisionError: division by zero") == 1, text
    assert "CompositeError" not in text
    assert errors == [["RanksError: the cell failed on rank 1 (traceback above)"]], errors
    text, errors = px_cells["both fail"]
    assert text.count("Traceback") == 2 and "bad rank 0" in text and "bad rank 1" in text, text
    assert errors == [["RanksError: the cell failed on ranks 0, 1 (traceback above)"]], errors


def test_px_stop_button_keeps_the_last_lines_and_ends_in_one_line(px_cells):
    text, errors = px_cells["stopped"]
    # printed a moment before the stop: still in the rank's buffer when the stop came
    assert "before the stop 0" in text and "before the stop 1" in text, text
    assert "KeyboardInterrupt" not in text and "Traceback" not in text, text
    assert "the ranks stopped" not in text, text               # said once, by the cell's error
    assert len(errors) == 1 and len(errors[0]) == 1, errors   # the cell failed: Run All stops here
    assert errors[0][0].startswith("RanksInterrupted: the ranks stopped"), errors
    text, errors = px_cells["after the stop"]
    assert not errors and "still here 0" in text and "still here 1" in text, (text, errors)


def test_failed_on_ranks_names_the_ranks_and_keeps_unshown_errors():
    from ddp_lab.engine._pxmagic import FailedOnRanks
    error = interactive.RanksError("x", [(0, "EngineError: engine 0 died"), (1, "ValueError: bad")])
    failed = FailedOnRanks(error, shown={1})
    assert isinstance(failed, interactive.RanksError) and failed.errors == error.errors
    # rank 1's traceback was streamed; rank 0 died without one, so its line is in the error itself
    assert failed._render_traceback_() == ["RanksError: the cell failed on ranks 0, 1",
                                           "rank 0: EngineError: engine 0 died"]
    shown = set()
    late = FailedOnRanks(error, shown)  # made when the reply came; the errors streamed after it
    shown.update({0, 1})
    assert late._render_traceback_() == ["RanksError: the cell failed on ranks 0, 1 (traceback above)"]


def test_stream_errors_once_drops_only_a_stopped_cells_interrupts():
    from ddp_lab.engine._pxmagic import stream_errors_once
    passed = []

    class Result:  # what stream_output() calls, per engine, for each message a rank sends
        def _iopub_streaming_output_callback(self, eid, future, msg):
            passed.append((eid, msg["content"].get("ename") or msg["content"].get("text")))

    result = Result()
    shown = stream_errors_once(result)

    def message(kind, **content):
        return {"header": {"msg_type": kind}, "content": content}
    result._iopub_streaming_output_callback(0, None, message("stream", name="stdout", text="hi"))
    result._iopub_streaming_output_callback(0, None, message("error", ename="KeyboardInterrupt"))
    result._iopub_streaming_output_callback(1, None, message("error", ename="ValueError"))
    assert passed == [(0, "hi"), (1, "ValueError")] and shown == {1}


# --- loopback only, whatever the hostname resolves to -------------------------------------------
# A machine whose hostname resolves to an address of its network (as on many LAN and cluster
# nodes): in a namespace of its own, the hostname maps to 10.99.0.1, an address of a veth there.
ELSEWHERE = ('hostname ddp-lab-elsewhere && ip link set lo up && ip link add v0 type veth peer name v1 && '
             'ip addr add 10.99.0.1/24 dev v0 && ip link set v0 up && ip link set v1 up && '
             'cp /etc/hosts "$0" && echo "10.99.0.1 ddp-lab-elsewhere" >> "$0" && mount --bind "$0" /etc/hosts && '
             'exec "$@"')
LIVE_RANKS = """
import json, socket, sys
sys.path.insert(0, sys.argv[1])
from conftest import listening, loopback
from ddp_lab.engine import interactive
ranks = interactive.start(nproc=2, magics=False)
try:
    ranks.run("t = torch.ones(1) * (rank + 1)")
    summed = [t.item() for t in ranks.collective("all_reduce", "t")]
    ifname = ranks.gather("os.environ.get('GLOO_SOCKET_IFNAME')")
    # only these ranks run in this namespace: every listener here is theirs
    exposed = sorted(f"{a}:{p}" for a, p in listening("/proc/net").values() if not loopback(a))
    print(json.dumps({"resolves": socket.gethostbyname(socket.gethostname()), "summed": summed,
                      "ifname": ifname, "exposed": exposed}))
finally:
    ranks.stop()
"""


def test_ranks_listen_on_loopback_where_the_hostname_resolves_to_the_network(tmp_path, monkeypatch):
    from ddp_lab.engine import netcluster
    ok, why = netcluster.available()
    if not ok:
        pytest.skip(f"needs network namespaces: {why}")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    program = tmp_path / "live_ranks.py"
    program.write_text(LIVE_RANKS)
    cmd = [*netcluster.UNSHARE, "--uts", "sh", "-c", ELSEWHERE, str(tmp_path / "hosts"),
           sys.executable, str(program), str(Path(__file__).parent)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert seen["resolves"] == "10.99.0.1"   # the hostname points at the network, as on such nodes
    assert seen["summed"] == [3.0, 3.0]
    assert seen["ifname"] == ["lo", "lo"]
    assert seen["exposed"] == [], f"the live ranks listen on the network: {seen['exposed']}"


def test_an_error_that_came_before_streaming_began_is_shown_once(capsys):
    """ipyparallel's stream_output() replays a rank's printed lines that arrived before it was entered,
    not its error: a rank that fails at once had its traceback lost (seen once in CI). replay_errors
    prints it, and the stream does not print it a second time when its message comes after."""
    from types import SimpleNamespace

    import ipyparallel.error as ipp_error
    from ddp_lab.engine import _pxmagic
    tb = "Traceback (most recent call last):\n  File \"<cell>\", line 2\nZeroDivisionError: division by zero"
    err = ipp_error.RemoteError("ZeroDivisionError", "division by zero", tb)
    futures = [SimpleNamespace(output=SimpleNamespace(metadata={"error": None})),
               SimpleNamespace(output=SimpleNamespace(metadata={"error": err}))]
    streamed = []
    result = SimpleNamespace(_targets=[0, 1], _children=futures,
                             _iopub_streaming_output_callback=lambda eid, f, msg: streamed.append(eid))
    shown = _pxmagic.stream_errors_once(result)
    _pxmagic.replay_errors(result, shown)
    assert shown == {1} and capsys.readouterr().err.count("ZeroDivisionError: division by zero") == 1
    result._iopub_streaming_output_callback(1, futures[1], {"header": {"msg_type": "error"},
                                                            "content": {"ename": "ZeroDivisionError"}})
    assert streamed == []  # the late message of the same error: not streamed again
    result._iopub_streaming_output_callback(0, futures[0], {"header": {"msg_type": "error"},
                                                            "content": {"ename": "ValueError"}})
    assert streamed == [0] and shown == {0, 1}
