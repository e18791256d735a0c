"""ddp_lab.lessons.profiling (trace -> step budget), ddp_lab.lessons.profiling.model, and nb08_profile on 2 ranks."""
import json

import pytest

from ddp_lab.engine import launch
from ddp_lab.lessons import profiling
from ddp_lab.lessons.profiling import model as pm


def X(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "cat": cat}


def step_events(t0, comm=((3000, 5000),), rank_tid=1):
    """One step at t0 (us): data 1 ms, forward 2 ms, backward 4 ms of which 3 ms of autograd ops,
    optimizer 1 ms; all-reduces on thread 2 at the given offsets."""
    p = profiling.PREFIX
    ev = [X(p + "step", t0, 9000), X(p + "data", t0, 1000), X(p + "forward", t0 + 1000, 2000),
          X(p + "backward", t0 + 3000, 4000),
          X("autograd::engine::evaluate_function: AddmmBackward0", t0 + 3000, 2000),
          X("autograd::engine::evaluate_function: AddmmBackward0", t0 + 5500, 1000),
          X(p + "optimizer", t0 + 7500, 1000)]
    ev += [X("gloo:all_reduce", t0 + 3000 + a, b - a, tid=2) for a, b in comm]
    return ev


def trace(*events, rank=0):
    return {"distributedInfo": {"rank": rank}, "traceEvents": [e for evs in events for e in evs]}


def test_interval_algebra():
    assert profiling.union([(5, 7), (1, 3), (2, 4)]) == [(1, 4), (5, 7)]
    assert profiling.intersect([(0, 10)], [(2, 3), (8, 12)]) == [(2, 3), (8, 10)]
    assert profiling.subtract([(0, 10)], [(2, 3), (8, 12)]) == [(0, 2), (3, 8)]
    assert profiling.length([(0, 2), (1, 3)]) == 3


def test_budget_splits_hidden_and_exposed_comm():
    # backward spans 3-7 ms, its ops run 3.0-5.0 and 5.5-6.5 ms; the all-reduce runs 4.5-6.5 ms
    steps = profiling.steps(trace(step_events(0, comm=((1500, 3500),))))
    assert len(steps) == 1 and set(steps[0].phases) == set(profiling.PHASES)
    b = profiling.budget(steps[0])
    assert b["comm"] == pytest.approx(2.0e-3)
    assert b["hidden comm"] == pytest.approx(1.5e-3)      # 4.5-5.0 and 5.5-6.5
    assert b["exposed comm"] == pytest.approx(0.5e-3)     # 5.0-5.5
    assert b["backward"] == pytest.approx(3.0e-3)
    # other: 6.5-7.5 (end of backward span to optimizer) and 8.5-9.0
    assert b["other"] == pytest.approx(1.5e-3)
    assert sum(b[k] for k in profiling.PARTS) == pytest.approx(b["step"]) == pytest.approx(9e-3)


def test_comm_past_backward_is_exposed_and_enqueue_is_not_compute():
    ev = step_events(0, comm=((500, 4500),))
    ev.append(X("c10d::allreduce_", 5500, 1000))      # the bucket handed over inside an autograd op
    b = profiling.budget(profiling.steps(trace(ev))[0])
    assert b["backward"] == pytest.approx(2.0e-3)         # 3.0-5.0 only: 5.5-6.5 was the enqueue
    assert b["exposed comm"] == pytest.approx(2.5e-3)     # 5.0-7.5: all-reduce with no compute
    assert sum(b[k] for k in profiling.PARTS) == pytest.approx(9e-3)


def test_steps_are_separated_and_ranks_read_from_files(tmp_path):
    for rank in (0, 1):
        t = trace(step_events(0), step_events(20000, comm=()), rank=rank)
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(t))
    run = profiling.load_run(tmp_path)
    assert sorted(run) == [0, 1]
    assert [len(s.comm) for s in run[1]] == [1, 0]
    # step 1's all-reduce runs 6-8 ms: hidden under backward's ops 6.0-6.5 and the optimizer 7.5-8.0
    assert profiling.overlap_fraction(run[0]) == pytest.approx(0.5)
    assert profiling.mean_budget(run[0])["step"] == pytest.approx(9e-3)
    merged = json.loads(profiling.merge(tmp_path).read_text())
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert sum(e.get("name") == "gloo:all_reduce" for e in merged["traceEvents"]) == 2


def test_predict_and_cluster():
    parts = {"data": 1.0, "forward": 2.0, "backward": 4.0, "optimizer": 1.0, "other": 0.5}
    assert pm.predict(parts, 1, nbytes=1e6, alpha=1e-4, beta=1e-9, overlap=0.5)["step"] == pytest.approx(8.5)
    two = pm.predict(parts, 2, nbytes=1e6, alpha=1e-4, beta=1e-9, overlap=0.0)
    assert two["divides"] == pytest.approx(3.5) and two["fixed"] == pytest.approx(1.5)
    assert two["comm"] == pytest.approx(2 * 1e-4 + 1e6 * 1e-9)
    shared = pm.predict(parts, 4, nbytes=0, alpha=0, beta=0, overlap=0, devices=2)
    assert shared["divides"] == pytest.approx(7.0 / 4 * 2)
    fast = pm.cluster(25.6e6, 8, "NVLink 3 (A100, 300 GB/s)", compute_ms=200, overlap=0.7)
    slow = pm.cluster(25.6e6, 8, "25 Gb/s Ethernet", compute_ms=200, overlap=0.7)
    half = pm.cluster(25.6e6, 8, "25 Gb/s Ethernet", compute_ms=200, overlap=0.7, grad_bytes=2)
    assert 1 < slow["speedup"] < half["speedup"] < fast["speedup"] <= 8
    assert pm.cluster(25.6e6, 1, "25 Gb/s Ethernet", compute_ms=200, overlap=0)["speedup"] == pytest.approx(1)


def test_program_traces_and_straggler(tmp_path):
    """A real 2-rank run: one trace per rank, parts add up, the straggler's sleep lands in rank 0's
    all-reduce (ordering on one clock, not durations, so a busy machine cannot flip it)."""
    run = launch.torchrun("-m ddp_lab.experiments.nb08_profile", nproc=2, threads=1, stream=False, timeout=180,
                          args=["--out", str(tmp_path), "--models", "small", "--sizes", "1,2", "--warmup", "1",
                                "--rounds", "2", "--steps", "2", "--profile", "3", "--straggler-ms", "30",
                                "--logging", "--log-every", "2"])
    assert [len(r["step_s"]) for r in run.select(kind="timing", model="small", n=2)] == [4, 4]
    assert sorted(p.name for p in (tmp_path / "small_n1").iterdir()) == ["rank0.json"]
    plain = profiling.load_run(tmp_path / "small_n2")
    late = profiling.load_run(tmp_path / "straggler_n2")
    assert sorted(plain) == sorted(late) == [0, 1]
    assert all(len(s) == 3 for s in list(plain.values()) + list(late.values()))
    assert all(len(s.comm) == 1 for steps in plain.values() for s in steps)
    timed = {r["rank"]: r["step_s"] for r in run.select(kind="profiled", model="small", n=2)}
    for rank, steps in plain.items():
        for s, t in zip(steps, timed[rank]):
            b = profiling.budget(s)
            assert sum(b[k] for k in profiling.PARTS) == pytest.approx(b["step"])
            assert b["step"] <= t + 1e-3
    for s0, s1 in zip(late[0], late[1]):
        assert profiling.budget(s1)["data"] >= 0.030
        assert s0.comm[-1][1] > s1.phases["data"][1]   # rank 0's all-reduce waited for rank 1
    # the logging rounds: the process group's own count of collectives, beyond what .item() ran (DDP's
    # all-reduces), is one reduction per step logged every step and one per N steps logged every N
    log = {r["way"]: r for r in run.select(kind="logging", rank=0)}
    extra = {w: sum(log[w]["collectives"]) - sum(log["item"]["collectives"]) for w in ("all_reduce", "every_n")}
    assert extra["all_reduce"] == len(log["all_reduce"]["calls_s"]) == 8 * 4 * 2
    assert extra["every_n"] == len(log["every_n"]["calls_s"]) == 8 * 4
