"""ddp_lab.engine.elastic: phases read from records, and no process left when the driving code fails."""
import gc
import tempfile

import pytest

from ddp_lab.engine import elastic

from conftest import processes_with, wait_until


def rec(step, world_size, t, restart=0, agent="A"):
    return {"kind": "step", "rank": 0, "step": step, "world_size": world_size, "t": t, "restart": restart,
            "agent": agent}


def test_phases_split_on_world_size_and_on_restarts():
    records = ([rec(s, 2, s) for s in (1, 2, 3)] + [rec(s, 1, 10 + s, restart=1) for s in (3, 4)]
               + [rec(s, 1, 20 + s, restart=2) for s in (4, 5)]       # same size, a new start
               + [{**rec(9, 2, 30), "rank": 1}] + [rec(5, 2, 40, 2, "C"), rec(6, 2, 41, 2, "C")])
    got = [(p["world_size"], p["first"], p["last"]) for p in elastic.phases(records)]
    assert got == [(2, 1, 3), (1, 3, 4), (1, 4, 5), (2, 5, 6)]
    assert [r["step"] for r in elastic.steps(records, world_size=1, since=20)] == [4, 5]


def test_an_exception_in_the_driver_stops_every_agent_and_worker(tmp_path, monkeypatch):
    """...and leaves no torchelastic_* log folder of its agents behind in the temp dir."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    with pytest.raises(RuntimeError, match="the driver failed"):
        with elastic.Cluster("-m ddp_lab.experiments.nb10_elastic --ckpt {ckpt} --steps 100000") as c:
            c.start("A", host=True)
            c.start("B")
            c.wait(lambda r: len(elastic.steps(r, 2)) >= 2, "world 2", timeout=240)
            workers = [p for p in processes_with(str(c.ckpt)) if "nb10_elastic" in " ".join(p.cmdline())]
            assert len(workers) >= 4  # two agents and two workers carry the checkpoint path
            raise RuntimeError("the driver failed")
    assert wait_until(lambda: not processes_with(str(c.dir)), timeout=5), processes_with(str(c.dir))
    assert all(a.poll() is not None for a in c.agents.values())
    del c
    gc.collect()  # the Cluster's folder goes with it
    assert not list(tmp_path.glob("torchelastic_*")) and not list(tmp_path.glob("ddp_lab_elastic_*")), \
        sorted(p.name for p in tmp_path.iterdir())
