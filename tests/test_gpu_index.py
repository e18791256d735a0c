"""No notebook, module or script picks a GPU by global rank (on node 2 of 8-GPU nodes, rank 9
would ask for a ninth GPU), and the live ranks bind their GPU in init_process_group."""
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp_lab import check
from ddp_lab.engine import interactive

ROOT = Path(__file__).resolve().parents[1]


def test_the_workbook_never_picks_a_gpu_by_global_rank():
    findings, errors, checked = check.check_paths(
        [ROOT / "ddp_lab", ROOT / "scripts", ROOT / "notebooks"], select=["DDP018"])
    assert checked > 100 and not errors, errors
    assert findings == [], "\n".join(f"{f.path}:{f.line}: {f.message}" for f in findings)


def _join(monkeypatch, backend: str, rank: int = 1, port: int = 29999):
    calls = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: calls.setdefault("store", (a, kw)))
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        # The join code sets these in os.environ. setenv first, so that monkeypatch records the
        # original state even when the variable was absent (delenv(raising=False) records nothing
        # then): otherwise RANK=1 and WORLD_SIZE=2 outlive the test, and every later single-process
        # run of a script started from this process waits for a rank 0 that never comes.
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    shell = types.SimpleNamespace(InteractiveTB=types.SimpleNamespace(set_mode=lambda mode: None))
    namespace = {"get_ipython": lambda: shell}
    exec(interactive._join_code(rank, 2, port, backend, 5), namespace)
    return calls, namespace


def test_live_nccl_ranks_bind_the_gpu_of_their_local_rank(monkeypatch):
    calls, ns = _join(monkeypatch, "nccl")
    assert ns["local_rank"] == 1 and ns["device"] == torch.device("cuda", 1)
    assert calls["set_device"] == torch.device("cuda", 1)
    assert calls["init"]["device_id"] == torch.device("cuda", 1)   # no barrier() device warning


def test_the_join_leaves_the_environment_as_it_found_it():
    import os
    before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    with pytest.MonkeyPatch.context() as mp:
        _join(mp, "gloo")
        assert os.environ["RANK"] == "1"                 # the join code really set it
    assert {k: os.environ.get(k) for k in before} == before


def test_live_gloo_ranks_stay_on_the_cpu_without_a_device_id(monkeypatch):
    calls, ns = _join(monkeypatch, "gloo")
    assert ns["device"] == torch.device("cpu") and "set_device" not in calls
    assert "device_id" not in calls["init"] and calls["init"]["rank"] == 1


def test_rank_0_serves_the_store_on_loopback_only(monkeypatch):
    """The store gets a socket bound to 127.0.0.1 (left to itself it would listen on every interface)."""
    import socket
    calls, _ = _join(monkeypatch, "gloo", rank=0, port=0)
    (host, port, world, master), kw = calls["store"]
    assert (host, world, master) == ("127.0.0.1", 2, True) and calls["init"]["store"] is calls["store"]
    listener = socket.socket(fileno=kw["master_listen_fd"])
    try:
        assert listener.getsockname()[0] == "127.0.0.1"
    finally:
        listener.close()
    calls, _ = _join(monkeypatch, "gloo", rank=1)
    assert calls["store"][0][3] is False and calls["store"][1]["master_listen_fd"] is None
