"""`ddp-lab doctor`: the real run on this machine, and each check's warning when its problem is made."""
import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_lab import cli, doctor
from ddp_lab.doctor import allreduce, checks
from ddp_lab.engine import netcluster

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {"python", "torch", "driver", "gpus", "backends", "allreduce_gloo", "allreduce_nccl", "master_port",
            "hostname", "shm", "open_files", "cores", "disk", "torchrun", "cluster", "across_nodes"}


def test_json_run_on_this_machine_with_a_real_allreduce(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddp_lab.doctor", "--json", "--ckpt-dir", str(tmp_path),
                           "--min-free-gib", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    report = json.loads(proc.stdout)
    by_name = {c["name"]: c for c in report["checks"]}
    assert set(by_name) == EXPECTED
    assert proc.returncode == (0 if report["ok"] else 1)
    assert {c["status"] for c in report["checks"]} <= documented_statuses()
    assert all(set(c) == set(documented_fields()) for c in report["checks"]) and set(report) == {"checks", "ok"}
    gloo = by_name["allreduce_gloo"]
    assert gloo["status"] == "pass", gloo
    assert gloo["data"]["world"] == 2 and gloo["data"]["busbw_gbs"] > 0
    # two ranks: the ring's bus bandwidth equals the algorithm bandwidth (2(N-1)/N = 1)
    assert abs(gloo["data"]["busbw_gbs"] - gloo["data"]["algbw_gbs"]) < 1e-9
    assert by_name["disk"]["status"] == "pass"
    assert by_name["cluster"]["status"] == ("pass" if netcluster.available()[0] else "skip")


def test_allreduce_failure_is_reported_not_raised():
    result = allreduce.measure(2, backend="no-such-backend", megabytes=1, timeout=60)
    assert not result["ok"] and "no-such-backend" in result["error"].lower()


def test_busy_port_warns_and_names_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        c = checks.master_port(doctor.plan(master_port=port))
    assert c.status == "warn" and str(port) in c.detail and "--master_port" in c.fix
    free = checks.master_port(doctor.plan(master_port=port))  # the socket is closed now
    assert free.status == "pass"


def test_too_many_processes_for_the_cores_and_the_file_limit():
    n = checks.cores(doctor.plan()).data["cores"]
    assert checks.cores(doctor.plan(nproc=n)).status == "pass"
    over = checks.cores(doctor.plan(nproc=n + 1))
    assert over.status == "warn" and f"{n} core" in over.detail
    assert checks.open_files(doctor.plan(nproc=10**6)).status == "warn"


def test_disk_and_unresolvable_hostname(tmp_path, monkeypatch):
    assert checks.disk(doctor.plan(ckpt_dir=str(tmp_path / "not" / "yet"), min_free_gib=0)).status == "pass"
    assert checks.disk(doctor.plan(ckpt_dir=str(tmp_path), min_free_gib=10**9)).status == "warn"

    def no_dns(name):
        raise socket.gaierror(-2, "Name or service not known")
    monkeypatch.setattr(socket, "gethostbyname", no_dns)
    c = checks.hostname(doctor.plan())
    assert c.status == "fail" and "/etc/hosts" in c.fix


def test_torchrun_of_another_python_is_named(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text("#!/opt/other-env/bin/python3\nprint('hi')\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    c = checks.torchrun_on_path(doctor.plan())
    assert c.status == "warn" and "/opt/other-env/bin/python3" in c.detail
    fake.write_text(f"#!{Path(sys.executable).parent / 'python3'}\nprint('hi')\n")
    assert checks.torchrun_on_path(doctor.plan()).status == "pass"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert checks.torchrun_on_path(doctor.plan()).status == "warn"


def test_cli_subcommand_and_a_broken_check_is_a_failure(capsys, monkeypatch):
    rc = cli.main(["doctor", "--skip-allreduce"])
    out = capsys.readouterr().out
    assert rc == (1 if "FAIL " in out else 0) and "passed," in out and "allreduce" not in out

    def broken(plan):
        raise OSError("disk on fire")
    monkeypatch.setattr(doctor, "ALL", [checks.python_version, broken])
    assert cli.main(["doctor", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"]
    assert report["checks"][1] == {**report["checks"][1], "name": "broken", "status": "fail"}
    assert "disk on fire" in report["checks"][1]["detail"]


def test_driver_older_than_the_cuda_runtime_fails(tmp_path, monkeypatch):
    import torch
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '| NVIDIA-SMI 535.104.05   Driver Version: 535.104.05   CUDA Version: 12.2 |'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    old = checks.driver(doctor.plan())
    assert old.status == "fail" and "12.2" in old.detail and "13.0" in old.detail and "driver" in old.fix
    monkeypatch.setattr(torch.version, "cuda", "12.1")
    assert checks.driver(doctor.plan()).status == "pass"
    monkeypatch.setattr(torch.version, "cuda", None)
    assert checks.driver(doctor.plan()).status == "warn"   # a GPU driver, and a CPU build of torch


def test_the_cluster_check_says_why_it_is_not_available(monkeypatch):
    monkeypatch.setattr(netcluster, "available", lambda: (False, "no tc here: install iproute2"))
    c = checks.localhost_cluster(None)
    assert c.status == "skip" and "install iproute2" in c.detail


def test_across_nodes_needs_a_node_rank_and_node_0_alone_listens():
    assert checks.across_nodes(doctor.plan()).status == "skip"
    skipped = checks.across_nodes(doctor.plan(nnodes=2))
    assert skipped.status == "skip" and "--node-rank" in skipped.detail
    wrong = checks.across_nodes(doctor.plan(nnodes=2, node_rank=2))
    assert wrong.status == "fail" and "0..1" in wrong.detail
    other = checks.master_port(doctor.plan(nnodes=2, node_rank=1, master_addr="10.0.0.7"))
    assert other.status == "skip" and "10.0.0.7" in other.detail


def test_across_nodes_failure_names_the_fix(monkeypatch):
    monkeypatch.setattr(allreduce, "across", lambda *a, **k: {"ok": False, "error": "Connection refused"})
    c = checks.across_nodes(doctor.plan(nnodes=2, node_rank=1, master_addr="10.0.0.7", master_port=29511))
    assert c.status == "fail" and "Connection refused" in c.detail and "29511" in c.fix and "GLOO_SOCKET_IFNAME" in c.fix


def _help() -> str:
    out = subprocess.run([sys.executable, "-m", "ddp_lab.cli", "doctor", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def documented_fields(text=None) -> list:
    """The field names --help lists for each check of --json (the lines under "each CHECK has")."""
    block = (text or _help()).split("each CHECK has\n", 1)[1].split("\nstatus:\n", 1)[0]
    return re.findall(r"^  (\w+) ", block, re.M)


def documented_statuses(text=None) -> set:
    block = (text or _help()).split("\nstatus:\n", 1)[1].split("\nexit status:", 1)[0]
    return set(re.findall(r"^  (\w+) ", block, re.M))


def test_help_documents_every_json_field_and_exactly_the_statuses_the_checks_use():
    text = _help()
    assert documented_fields(text) == ["name", "status", "detail", "fix", "data"]
    assert list(checks.Check("x", "pass", "").to_dict()) == documented_fields(text)
    assert documented_statuses(text) == {"pass", "warn", "fail", "skip"} == set(doctor.MARK)
    assert '"ok": false when a check failed' in text
    # a check cannot report a status the help does not explain
    try:
        checks.Check("x", "ok", "")
    except ValueError as e:
        assert "'ok'" in str(e) and "pass, warn, fail, skip" in str(e)
    else:
        raise AssertionError("a status outside the documented set was accepted")


def test_torchrun_fix_names_this_python_quoted_for_the_shell(tmp_path, monkeypatch):
    # `python3` on PATH need not have torch: the fix names the interpreter running the doctor
    spaced = "/opt/my env/bin/python3"
    monkeypatch.setattr(sys, "executable", spaced)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    missing = checks.torchrun_on_path(doctor.plan())
    assert missing.status == "warn" and "'/opt/my env/bin/python3' -m torch.distributed.run" in missing.fix
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text("#!/opt/other-env/bin/python3\n")
    monkeypatch.setenv("PATH", str(bin_dir))
    other = checks.torchrun_on_path(doctor.plan())
    assert other.status == "warn" and "'/opt/my env/bin/python3' -m torch.distributed.run" in other.fix
    # with the real interpreter, the command in the fix runs torchrun
    monkeypatch.undo()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    use = checks.torchrun_on_path(doctor.plan()).data["use"]
    assert shlex.split(use)[0] == sys.executable
    out = subprocess.run(f"{use} --help", shell=True, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and "--nproc-per-node" in out.stdout.replace("_", "-"), out.stderr[-500:]


def test_a_master_name_that_resolves_to_loopback_fails_at_once(monkeypatch):
    """Node 1 whose hosts file maps node 0's name to 127.x looked for node 0 on itself: two minutes of
    waiting, then '1/2 clients joined'. Name resolution alone shows it, at once."""
    called = []
    monkeypatch.setattr(allreduce, "across", lambda *a, **k: called.append(a) or {"ok": False, "error": "timeout"})
    real = socket.getaddrinfo

    def resolve(host, *a, **k):  # this node's hosts file: head -> 127.0.1.1, nowhere unknown
        if host == "nowhere":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if host == "head":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
        return real(host, *a, **k)

    monkeypatch.setattr(checks.socket, "getaddrinfo", resolve)
    c = checks.across_nodes(doctor.plan(nnodes=2, node_rank=1, master_addr="head"))
    assert c.status == "fail" and called == [], c
    assert "127.0.1.1" in c.detail and "loopback" in c.detail and "name resolution" in c.detail
    assert "/etc/hosts" in c.fix and "IP address" in c.fix
    unknown = checks.across_nodes(doctor.plan(nnodes=2, node_rank=1, master_addr="nowhere"))
    assert unknown.status == "fail" and "does not resolve" in unknown.detail and called == []
    # a loopback address typed as such means every node on one machine: the all-reduce runs
    checks.across_nodes(doctor.plan(nnodes=2, node_rank=1, master_addr="127.0.0.1"))
    assert len(called) == 1


def test_different_torch_across_nodes_is_named():
    import torch
    import torch.distributed as dist
    store = dist.HashStore()
    store.set("ddp_lab_doctor/torch/1", "2.4.0")  # what node 1 wrote
    mine = re.escape(torch.__version__)
    expected = rf"torch differs across the nodes: node 0 has torch {mine}, node 1 has torch 2\.4\.0"
    with pytest.raises(RuntimeError, match=expected):
        allreduce.same_torch(store, 0, 2)
    store.set("ddp_lab_doctor/torch/1", torch.__version__)
    allreduce.same_torch(store, 0, 2)  # the same torch: nothing to say


def test_a_torch_mismatch_names_its_fix(monkeypatch):
    error = "RuntimeError: torch differs across the nodes: node 0 has torch 2.14.1, node 1 has torch 2.4.0"
    monkeypatch.setattr(allreduce, "across", lambda *a, **k: {"ok": False, "error": error})
    c = checks.across_nodes(doctor.plan(nnodes=2, node_rank=1, master_addr="10.0.0.7"))
    assert c.status == "fail" and "node 1 has torch 2.4.0" in c.detail and "same torch on every node" in c.fix


def test_torch_below_the_workbooks_floor_warns_and_below_the_scripts_fails(monkeypatch):
    """The two floors tried (ddp_lab.TORCH_FLOOR for the notebooks, SCRIPTS_TORCH_FLOOR for scripts/):
    2.14 passes, 2.10 warns that only scripts/ run, 2.3 fails; pyproject and environment.yml declare
    the workbook's floor."""
    import torch
    import ddp_lab
    seen = {}
    for version in ("2.14.1", "2.10.0+cu128", "2.3.1"):
        monkeypatch.setattr(torch, "__version__", version)
        seen[version] = checks.torch_version(None)
    assert seen["2.14.1"].status == "pass"
    assert seen["2.10.0+cu128"].status == "warn" and "scripts/ run on it" in seen["2.10.0+cu128"].detail
    assert seen["2.3.1"].status == "fail" and "torch>=2.14" in seen["2.3.1"].fix
    floor = ".".join(map(str, ddp_lab.TORCH_FLOOR))
    root = Path(__file__).resolve().parents[1]
    assert f'"torch>={floor}"' in (root / "pyproject.toml").read_text()
    assert f"pytorch>={floor}" in (root / "environment.yml").read_text()


def test_paths_are_printed_relative_to_the_workbook_or_home_and_kept_whole_in_data(monkeypatch, tmp_path):
    # a stored notebook output must not show one machine's folders
    assert checks.shown(checks.WORKBOOK / ".venv" / "bin" / "python") == ".venv/bin/python"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert checks.shown(tmp_path / "envs" / "bin" / "python") == "~/envs/bin/python"
    assert checks.shown("/opt/conda/bin/python") == "/opt/conda/bin/python"
    c = checks.python_version(None)
    assert checks.shown(sys.executable) in c.detail
