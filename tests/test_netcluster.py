"""The localhost cluster (ddp_lab.engine.netcluster): nodes in network namespaces of their own,
joined by a shaped link, built as an ordinary user, and nothing left after it.

Launches: an all-reduce sweep across a 20 Mbit/s link; one that times out, one whose kernel is
interrupted and one whose kernel is killed (nothing may be left of any); an elastic job that loses
a node. Where the machine cannot build the cluster, the tests that need it say why and skip, except under CI, which has what it needs (`.ci/run` installs
iproute2). The lessons' link cells (notebooks 00, 03, 08, 10) are the rest of its tests.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import PROGRAMS, processes_with, wait_until
from ddp_lab.engine import elastic, launch, netcluster, private

OK, WHY = netcluster.available()
needs_cluster = pytest.mark.skipif(not OK and not os.environ.get("CI"), reason=WHY)


def host_links():
    return subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout


def ours_left():
    """Processes below this one that belong to a launch: none may outlive it."""
    return [p for p in psutil.Process().children(recursive=True)
            if any(k in " ".join(p.cmdline()) for k in ("netcluster", "torch.distributed.run", "allreduce_bench"))]


def test_ci_has_the_cluster():
    if not os.environ.get("CI"):
        pytest.skip("outside CI a machine may lack the cluster: its cells then skip with the reason")
    assert OK, WHY  # the lessons' link cells may not skip silently where the workbook is tested


@needs_cluster
def test_an_all_reduce_crosses_the_shaped_link_and_nothing_is_left(tmp_path):
    before = host_links()
    out = tmp_path / "bench.json"
    run = launch.torchrun("allreduce_bench.py", nproc=1, nnodes=2, link="20mbit", stream=False, timeout=180,
                          args=["--min-bytes", "1M", "--max-bytes", "4M", "--iters", "3", "--warmup", "1",
                                "--device", "cpu", "--json-out", out])
    assert run.returncode == 0
    bench = json.loads(out.read_text())
    assert bench["world_size"] == 2
    rate = 20e6 / 8   # bytes per second
    for r in bench["results"]:
        # the ring sends 2(N-1)/N * S bytes per rank, over the link: a 20 Mbit/s link cannot be beaten
        assert r["busbw"] <= rate * 1.15, (r, rate)
    assert host_links() == before, "the launch left links in this machine's namespace"
    assert ours_left() == []


@needs_cluster
def test_a_timed_out_cluster_leaves_no_process_and_no_link(tmp_path):
    before = host_links()
    (tmp_path / "sleeps.py").write_text("import time\nprint('asleep', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(launch.LaunchError, match="timed out"):
        launch.torchrun(str(tmp_path / "sleeps.py"), nproc=1, nnodes=2, link="unshaped", stream=False,
                        timeout=8, env={"DDP_LAB_AUTOPSY": "0"})
    assert ours_left() == []
    assert host_links() == before


@needs_cluster
@pytest.mark.parametrize("how", ["interrupt", "kill"])
def test_an_interrupted_or_killed_kernel_leaves_no_process_and_no_link(marker, how):
    """The stop button (SIGINT: KeyboardInterrupt in the kernel) and a dead kernel (SIGKILL, as
    "restart kernel" does) both end in the guardian killing the cluster's tree, as a timeout does."""
    before = host_links()
    kernel = subprocess.Popen([sys.executable, str(PROGRAMS / "drive_launch.py"), str(PROGRAMS / "sleeper.py"),
                               marker, "300", "unshaped"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: Path(marker + ".ready").exists(), timeout=120), "the ranks never started"
        assert len(processes_with(marker)) >= 2
        if how == "interrupt":
            kernel.send_signal(signal.SIGINT)
            assert kernel.wait(timeout=30) == 130  # KeyboardInterrupt reached the cell
    finally:
        kernel.kill()
        kernel.wait()
    assert wait_until(lambda: not processes_with(marker), timeout=20), processes_with(marker)
    assert host_links() == before


@needs_cluster
def test_a_lost_node_takes_its_processes_and_its_link_and_the_driver_leaves_nothing():
    """elastic.Cluster(link=...): a node is lost with everything in its namespace; when the driving
    code then fails, the rest of the cluster goes too, links included."""
    before = host_links()
    with pytest.raises(RuntimeError, match="the driver failed"):
        with elastic.Cluster("-m ddp_lab.experiments.nb10_elastic --ckpt {ckpt} --steps 100000 --timeout 5",
                             link="unshaped") as c:
            c.start("A", host=True)
            c.start("B")
            c.wait(lambda r: len(elastic.steps(r, 2)) >= 2, "world 2", timeout=240)
            b = {p.pid for p in processes_with(str(c.ckpt)) if "DDP_LAB_AGENT=B" in _environ(p)}
            assert len(b) >= 2                   # B's agent and its worker
            lost = c.kill("B")
            assert b <= set(lost["killed"]) and not [p for p in b if _alive(p)]
            assert "h0" in lost["links"] and "h1" not in lost["links"]    # B's link went down with it
            assert c.agents["B"].poll() is not None and c.agents["A"].poll() is None
            raise RuntimeError("the driver failed")
    assert wait_until(lambda: not processes_with(str(c.dir)), timeout=5), processes_with(str(c.dir))
    assert c.server.poll() is not None and host_links() == before and ours_left() == []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _environ(p: psutil.Process) -> str:
    try:
        return " ".join(f"{k}={v}" for k, v in p.environ().items())
    except psutil.Error:
        return ""


def test_bad_requests_name_the_fix(monkeypatch):
    with pytest.raises(ValueError, match="nnodes=2 or more"):
        launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=1, nnodes=1, link="1gbit")
    with pytest.raises(ValueError, match="'100mbit'"):
        launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=1, nnodes=2, link="fast")
    monkeypatch.setattr(netcluster, "available", lambda: (False, "no ip here: install iproute2"))
    with pytest.raises(launch.ClusterUnavailable, match="install iproute2"):
        launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=1, nnodes=2, link="1gbit")


def test_without_iproute2_one_line_says_what_to_install(monkeypatch):
    netcluster.available.cache_clear()
    monkeypatch.setattr(private.shutil, "which", lambda tool, path=None: None if tool == "tc" else "/usr/bin/" + tool)
    try:
        ok, why = netcluster.available()
    finally:
        netcluster.available.cache_clear()
    assert not ok and "tc" in why and "iproute2" in why and "\n" not in why


def test_rates_in_tcs_words():
    assert netcluster.rate_bits("100mbit") == 100e6 and netcluster.rate_bits("1gbit") == 1e9
    assert netcluster.rate_bits("unshaped") is None
    with pytest.raises(ValueError, match="at least 1mbit"):
        netcluster.rate_bits("500kbit")


def test_it_can_be_turned_off(monkeypatch):
    netcluster.available.cache_clear()
    monkeypatch.setenv("DDP_LAB_CLUSTER", "off")
    try:
        ok, why = netcluster.available()
    finally:
        netcluster.available.cache_clear()
    assert not ok and "DDP_LAB_CLUSTER=off" in why


def test_the_clusters_ranks_see_no_gpu():
    """NCCL between GPUs of one machine would bypass the link: the cluster runs on CPU ranks."""
    cmd = launch._cluster_cmd([["a"], ["b"]], "1gbit")
    envs = json.loads(cmd[cmd.index("--envs") + 1])
    assert envs == [{"CUDA_VISIBLE_DEVICES": ""}] * 2
    assert cmd[cmd.index("--link") + 1] == "1gbit"


def test_a_node_script_starts_each_node_as_an_operator_would():
    """launch_multinode.sh gets each node's variables; torchrun's options it lacks come as PET_ ones."""
    argv = launch._program_argv("train_ddp.py")
    cmds, envs = launch._script_cmds("launch_multinode.sh", argv, 1, 2, 29555, 1, ["--epochs", "1"])
    assert cmds == [["bash", str(launch.SCRIPTS / "launch_multinode.sh"), "--epochs", "1"]] * 2
    assert [e["NODE_RANK"] for e in envs] == ["0", "1"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["NNODES"], e["PET_MAX_RESTARTS"]) for e in envs} == \
        {(netcluster.node_addr(0), "29555", "2", "1")}
    with pytest.raises(ValueError, match="give link= too"):
        launch.torchrun("train_ddp.py", nproc=1, nnodes=2, node_script="launch_multinode.sh")
    with pytest.raises(ValueError, match="'launch_multinode.sh'"):
        launch.torchrun("train_ddp.py", nproc=1, nnodes=2, link="1gbit", node_script="slurm_ddp.sbatch")
    with pytest.raises(ValueError, match="program='train_ddp.py'"):
        launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=1, nnodes=2, link="1gbit",
                        node_script="launch_multinode.sh")


def test_shape_and_tx_bytes_work_on_a_node_only(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    for call in (lambda: netcluster.shape("100mbit"), netcluster.tx_bytes):
        with pytest.raises(RuntimeError, match=r"launch.torchrun\(\.\.\., nnodes=2, link="):
            call()
    with pytest.raises(ValueError, match="'100mbit'"):
        netcluster.shape("fast")


@needs_cluster
def test_on_nodes_runs_one_command_in_each_nodes_namespace():
    before = host_links()
    show = ["sh", "-c", "ip -br -4 addr show ddp0"]
    printed = launch.on_nodes([show, show], link="1gbit", timeout=60)
    assert [netcluster.node_addr(k) in out for k, out in enumerate(printed)] == [True, True], printed
    with pytest.raises(launch.LaunchError, match="a node failed"):
        launch.on_nodes([["true"], ["false"]], link="1gbit", timeout=60)
    assert launch.on_nodes([["true"], ["false"]], link="1gbit", timeout=60, check=False) == ["", ""]
    with pytest.raises(ValueError, match="2 or more"):
        launch.on_nodes([show], link="1gbit")
    assert host_links() == before and ours_left() == []


# An ordinary user's login PATH on Debian: no /usr/sbin, where iproute2 installs ip and tc
USER_PATH = "/usr/bin:/bin"
AS_A_USER = """
import sys
from ddp_lab.doctor import checks
from ddp_lab.engine import launch, private
print(private.mode())
print(checks.localhost_cluster(None).detail)
shape = [sys.executable, "-c", "from ddp_lab.engine import netcluster; netcluster.shape('10mbit'); print('shaped')"]
print(launch.on_nodes([shape, shape], link="unshaped", timeout=120))
"""


@needs_cluster
@pytest.mark.skipif(not any(os.path.exists(f"{d}/tc") for d in private.SBIN), reason="tc is not in an sbin folder here")
def test_ip_and_tc_in_sbin_are_found_where_path_lacks_it():
    env = {**os.environ, "PATH": USER_PATH}
    p = subprocess.run([sys.executable, "-c", AS_A_USER], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    mode, cluster, nodes = p.stdout.strip().splitlines()[-3:]
    assert mode == private.PRIVATE
    assert "localhost cluster not available" not in cluster and "available" in cluster, cluster
    assert nodes == str(["shaped\n", "shaped\n"])  # tc ran by name on each node


def test_a_tool_found_nowhere_is_named_with_where_it_was_looked_for(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))            # nothing on PATH
    monkeypatch.setattr(private, "SBIN", (str(tmp_path / "sbin"),))  # nor in the sbin folders
    netcluster.available.cache_clear()
    try:
        ok, why = netcluster.available()
    finally:
        netcluster.available.cache_clear()
    assert not ok and "unshare, ip, tc" in why and str(tmp_path / "sbin") in why and "install" in why, why


@needs_cluster
def test_a_download_on_the_clusters_nodes_is_told_they_have_no_network(tmp_path):
    program = tmp_path / "download.py"  # torchvision's error where nothing answers (test_private_ports)
    program.write_text("import socket, urllib.error\n"
                       "raise urllib.error.URLError(socket.gaierror(-3, 'Temporary failure in name resolution'))\n")
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(str(program), nproc=1, nnodes=2, link="unshaped", args=["--download"], timeout=120,
                        stream=False)
    message = str(info.value)
    assert "URLError" in message and message.count(private.CLUSTER_HINT) == 1, message
    assert "network=True" in private.CLUSTER_HINT
