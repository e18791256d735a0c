"""A local launch listens on loopback only: its processes run in a private network namespace
(ddp_lab.engine.private). Three real 2-rank jobs (a launch of 2 ranks on a node, as a notebook's; a
local launch of 2 nodes of one rank, which share one namespace; a `ddp-lab verify` run), each held open while the
machine's listening sockets are read from /proc; the rest are unit tests of wrap(), mode() and the
launch's spawn. The live ranks: test_interactive."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import listening, loopback, socket_inodes
from ddp_lab.engine import launch, private

# Each rank records its pid, says it is up (its process group, hence torchrun's store, exists),
# then waits for the test to read the sockets and open the gate.
PROGRAM = """
import os, sys, time
from pathlib import Path
from ddp_lab.engine import runtime
gate = Path(sys.argv[1])
with runtime.distributed() as ctx:
    ctx.record(kind="pid", pid=os.getpid())
    (gate / f"ready{ctx.rank}").write_text(str(os.getpid()))
    end = time.monotonic() + 240
    while not (gate / "open").exists() and time.monotonic() < end:
        time.sleep(0.1)
"""

# The same for `ddp-lab verify`, a plain torch.distributed script as a user's would be
SCRIPT = """
import os, sys, time
from pathlib import Path
import torch.distributed as dist
gate = Path(sys.argv[1])
dist.init_process_group("gloo")
(gate / f"ready{dist.get_rank()}").write_text(str(os.getpid()))
end = time.monotonic() + 240
while not (gate / "open").exists() and time.monotonic() < end:
    time.sleep(0.1)
dist.destroy_process_group()
"""


# Three kinds of job: a launch of 2 ranks on one node (a notebook's launch, `ddp-lab grade`), a local
# launch of 2 nodes of one rank (they share one namespace and meet on its loopback), and a
# `ddp-lab verify` run
@pytest.fixture(scope="module", params=["launch", "nodes", "verify"], ids=["2 ranks", "2 nodes", "verify"])
def job(request, tmp_path_factory):
    """One 2-rank job; while both ranks are up: the job's pids, their socket inodes, the
    listening sockets of this namespace and of the job's; then the Run (a launch) or the Report."""
    gate = tmp_path_factory.mktemp("gate")
    program = gate / "hold.py"
    program.write_text(SCRIPT if request.param == "verify" else PROGRAM)
    result = {"kind": request.param}

    def run():
        try:
            if request.param != "verify":
                nodes = {"nproc": 1, "nnodes": 2} if request.param == "nodes" else {"nproc": 2}
                result["run"] = launch.torchrun(str(program), args=[gate], timeout=300, stream=False, **nodes)
            else:
                from ddp_lab.verify import verify
                result["run"] = verify(program, args=[gate], timeout=300)
        except Exception as e:  # noqa: BLE001 - reported by the tests
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 280
    while not all((gate / f"ready{r}").exists() for r in (0, 1)):
        assert t.is_alive() and time.monotonic() < deadline, f"the ranks never came up: {result}"
        time.sleep(0.2)
    time.sleep(0.5)  # the agent's store was up before the ranks' process group; let it settle
    pids = [p.pid for p in psutil.Process().children(recursive=True)]
    seen = {"pids": pids, "inodes": set().union(*map(socket_inodes, pids)),
            "host": listening("/proc/net"), "ns": {}}
    for pid in pids:
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net"):
                seen["ns"] = listening(f"/proc/{pid}/net")
                break
        except OSError:
            pass
    (gate / "open").write_text("")
    t.join(timeout=300)
    seen.update(result)
    return seen


def test_the_job_ran_its_two_ranks_to_the_end(job):
    assert "error" not in job, job.get("error")
    if job["kind"] != "verify":
        assert sorted(r["rank"] for r in job["run"].select(kind="pid")) == [0, 1]
    else:
        report = job["run"]
        assert report.error is None and [(r["ranks"], r["returncode"]) for r in report.runs] == [(2, 0)], report.text()


def test_no_listener_of_the_job_is_reachable_from_the_network(job):
    if not private.available():
        pytest.skip(f"launches: {private.mode()}")
    exposed = {i: a for i, a in job["host"].items() if i in job["inodes"] and not loopback(a[0])}
    assert not exposed, f"the job listens on the machine's network: {exposed}"


def test_in_private_mode_the_job_listens_only_in_its_own_namespace(job):
    if not private.available():
        pytest.skip(f"launches: {private.mode()}")
    assert not set(job["host"]) & job["inodes"], "a listener of the job is in the machine's namespace"
    # ...yet the job does listen (torchrun's store, gloo), on the loopback of its own namespace
    assert set(job["ns"]) & job["inodes"], f"no listener of the job found in its namespace: {job['ns']}"


# --- the mechanism, without a launch -----------------------------------------------------
def test_wrap_puts_the_command_in_a_namespace_with_loopback_up(monkeypatch):
    monkeypatch.delenv(private.OFF_ENV, raising=False)
    monkeypatch.setattr(private, "_probe", lambda: (("unshare", "--net"), ""))
    assert private.wrap(["python", "x.py", 3]) == ["unshare", "--net", "--", "sh", "-c", private.LO_UP,
                                                   "sh", "python", "x.py", "3"]
    assert private.wrap(["python", "x.py"], network=True) == ["python", "x.py"]
    assert private.mode() == private.PRIVATE


def test_mode_says_why_there_is_no_private_namespace(monkeypatch):
    monkeypatch.delenv(private.OFF_ENV, raising=False)
    monkeypatch.setattr(private, "_probe", lambda: (None, "no unshare here (install util-linux)"))
    assert private.wrap(["python", "x.py"]) == ["python", "x.py"] and not private.available()
    assert "install util-linux" in private.mode() and "every interface" in private.mode()
    monkeypatch.setenv(private.OFF_ENV, "off")
    assert f"{private.OFF_ENV}=off" in private.mode()


@pytest.mark.skipif(not private.available(), reason=f"launches: {private.mode()}")
def test_a_wrapped_command_keeps_its_pid_and_sees_only_loopback():
    p = subprocess.Popen(private.wrap([sys.executable, "-c", "import os; print(os.getpid())"]),
                         stdout=subprocess.PIPE, text=True)
    assert int(p.communicate(timeout=60)[0]) == p.pid  # the launcher's kill and timeout reach it
    links = subprocess.run(private.wrap(["ip", "-o", "link"]), capture_output=True, text=True, timeout=60)
    assert [line.split(":")[1].strip() for line in links.stdout.splitlines()] == ["lo"]
    assert "UP" in links.stdout


def _spawned(monkeypatch, **kwargs) -> list:
    """The commands launch.torchrun starts, with their environments: [(cmd, env)], each replaced
    by a process that does nothing."""
    seen, real = [], subprocess.Popen

    def fake(cmd, **kw):
        if not isinstance(cmd, list) or cmd[0] not in (sys.executable, "unshare", "nsenter"):
            return real(cmd, **kw)   # not the launch's: e.g. ctypes asking /sbin/ldconfig for a library
        seen.append((cmd, kw["env"]))
        return real([sys.executable, "-c", "pass"], **kw)

    monkeypatch.setattr(launch.subprocess, "Popen", fake)
    monkeypatch.setenv("DDP_LAB_AUTOPSY", "0")
    launch.torchrun("-m ddp_lab.experiments.nb00_hello", **{"stream": False, **kwargs})
    return seen


def test_off_launches_exactly_as_before(monkeypatch):
    monkeypatch.setenv(private.OFF_ENV, "off")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    [(cmd, env)] = _spawned(monkeypatch)
    assert "GLOO_SOCKET_IFNAME" not in env
    assert cmd[:3] == [sys.executable, "-m", "ddp_lab.engine._reaper"] and "unshare" not in cmd
    assert private.Shared().enter(["x"]) == ["x"]


@pytest.mark.skipif(not private.available(), reason=f"launches: {private.mode()}")
def test_local_launches_are_wrapped_and_a_download_keeps_the_network(monkeypatch, capsys):
    monkeypatch.delenv(private.OFF_ENV, raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    [(one, env)] = _spawned(monkeypatch)
    assert env["GLOO_SOCKET_IFNAME"] == "lo"  # the namespace has no other interface
    after = one[one.index(private.LO_UP) + 2:]  # sh -c LO_UP sh CMD...
    assert one[0] == "unshare" and after[:3] == [sys.executable, "-m", "ddp_lab.engine._reaper"]
    nodes = [cmd for cmd, _ in _spawned(monkeypatch, nproc=1, nnodes=2)]  # both nodes join one namespace
    assert [c[0] for c in nodes] == ["nsenter", "nsenter"] and nodes[0][2] == nodes[1][2]
    [(download, _)] = _spawned(monkeypatch, args=["--download"], stream=True)
    assert download[0] == sys.executable
    assert "--download: this job keeps the machine's network" in capsys.readouterr().out


def test_torchs_warning_about_the_namespaces_missing_dns_stays_in_the_log_only():
    out = launch._Output(False, hide=private.NO_DNS_WARNINGS)
    warning = "[W1205 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3"
    for text in (warning, "step 1"):
        out.feed(f"<{out.token}:0>{text}", (0, "err"))
    assert out.rank_lines == {0: ["step 1"]} and f"[0]:{warning}" in out.lines


@pytest.mark.skipif(not private.available(), reason=f"launches: {private.mode()}")
def test_a_job_that_reaches_for_the_network_is_told_how_to_ask_for_it(tmp_path):
    # 192.0.2.1 is a documentation address (TEST-NET-1); in the private namespace there is no route
    # to anything but loopback, so the connect fails at once and no packet leaves the namespace
    program = tmp_path / "reach.py"
    program.write_text("import socket\nsocket.create_connection(('192.0.2.1', 9), timeout=5)\n")
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(str(program), nproc=1, timeout=120, stream=False)
    message = str(info.value)
    assert "Network is unreachable" in message and message.count(private.NO_NETWORK_HINT) == 1, message
    assert private.no_network_hint("ConnectionRefusedError: [Errno 111] Connection refused") == ""


# What torchvision's download raises where nothing answers: a URLError around the failed name lookup
OFFLINE = ("import socket, urllib.error\n"
           "raise urllib.error.URLError(socket.gaierror(-3, 'Temporary failure in name resolution'))\n")


def test_a_download_on_a_machine_without_network_names_network_true(tmp_path):
    """--download keeps the machine's network; where the machine has none, the bare URLError is
    followed by one line that says the job had it (network=True) and what to do instead."""
    program = tmp_path / "download.py"
    program.write_text(OFFLINE)
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(str(program), nproc=1, args=["--download"], timeout=120, stream=False)
    message = str(info.value)
    assert "URLError" in message and message.count(private.OFFLINE_HINT) == 1, message
    assert "network=True" in private.OFFLINE_HINT and "--data-dir" in private.OFFLINE_HINT
