"""The what-if model hides communication only under backward; the budget reads GPU (kineto) traces."""
import math

import pytest

from ddp_lab.lessons import costmodel, profiling
from ddp_lab.lessons.profiling import model as pm


def test_communication_hides_only_under_backward():
    r = pm.cluster(25.6e6, 8, "25 Gb/s Ethernet", compute_ms=200, overlap=1.0, scaling="strong")
    backward = 200 / 8 * pm.BACKWARD_SHARE
    assert r["backward_ms"] == pytest.approx(backward)
    assert r["exposed_ms"] >= r["comm_ms"] - backward - 1e-9
    assert r["speedup"] < 4        # 8 GPUs, 25 ms of compute each, a 60 ms all-reduce


def test_weak_and_strong_scaling_differ_as_the_model_says():
    """Fixed per-GPU batch (the default): backward keeps its one-GPU length, the speedup counts n
    batches per step. Fixed global batch: backward shrinks like 1/n. Same all-reduce in both."""
    n, ms, overlap = 8, 200.0, 0.7
    for link in pm.LINKS:
        weak = pm.cluster(25.6e6, n, link, ms, overlap)
        strong = pm.cluster(25.6e6, n, link, ms, overlap, scaling="strong")
        assert weak["scaling"] == "weak" and strong["scaling"] == "strong"
        assert weak["backward_ms"] == pytest.approx(ms * pm.BACKWARD_SHARE)
        assert strong["backward_ms"] == pytest.approx(ms / n * pm.BACKWARD_SHARE)
        assert weak["comm_ms"] == strong["comm_ms"] and weak["buckets"] == strong["buckets"]
        assert weak["exposed_ms"] <= strong["exposed_ms"] and weak["speedup"] > strong["speedup"]
        assert weak["step_ms"] == pytest.approx(ms + weak["exposed_ms"])
        assert weak["speedup"] == pytest.approx(n * ms / weak["step_ms"])          # throughput
        assert strong["speedup"] == pytest.approx(ms / strong["step_ms"])         # time to the same batch
        assert weak["efficiency"] == pytest.approx(weak["speedup"] / n)
    # the reviewer's arithmetic: a 60.8 ms all-reduce under 133 ms of backward exposes about 1 - overlap
    weak = pm.cluster(25.6e6, n, "25 Gb/s Ethernet", ms, overlap)
    strong = pm.cluster(25.6e6, n, "25 Gb/s Ethernet", ms, overlap, scaling="strong")
    assert weak["exposed_ms"] == pytest.approx((1 - overlap) * weak["comm_ms"], rel=1e-6)
    assert weak["speedup"] > 7 and strong["speedup"] < 3
    # one GPU: no all-reduce, the same step either way
    one = [pm.cluster(25.6e6, 1, "25 Gb/s Ethernet", ms, overlap, scaling=m) for m in pm.SCALINGS]
    assert all(r["speedup"] == pytest.approx(1.0) and r["exposed_ms"] == 0 for r in one)
    with pytest.raises(ValueError, match="'weak'.*'strong'"):
        pm.cluster(25.6e6, n, "25 Gb/s Ethernet", ms, overlap, scaling="fixed")
    assert pm.format_table(pm.cluster_table(25.6e6, n, ms, overlap, scaling="strong"), n).startswith(
        "8 GPUs, fixed global batch (strong scaling):")
    assert "fixed per-GPU batch" in pm.calculator_text()


def test_last_bucket_is_exposed_and_first_is_small():
    assert pm.ddp_buckets(100 * 2**20, 25) == [2**20] + [99 * 2**20 / 4] * 4
    assert pm.ddp_buckets(1000, 25) == [1000]
    # 1 MB then 3 MB, backward 10 ms, 1 ms + 1 ns/B per call: bucket 0 is ready at 2.5 ms, ends at
    # 3.5 + 1.05 = 4.55 ms; bucket 1 ready at 10 ms, ends at 10 + 1 + 3.15 ms: 4.15 ms exposed
    sizes, a, b = [2**20, 3 * 2**20], 1e-3, 1e-9
    comm, exposed = pm.comm_exposed(sizes, 2, a, b, t_backward=10e-3)
    assert comm == pytest.approx(sum(float(costmodel.ring(s, 2, a, b)) for s in sizes))
    assert exposed == pytest.approx(float(costmodel.ring(sizes[1], 2, a, b)))
    # without time to hide, everything is exposed; overlap caps the hidden share
    assert pm.comm_exposed(sizes, 2, a, b, t_backward=0.0)[1] == pytest.approx(comm)
    assert pm.comm_exposed(sizes, 2, a, b, 10e-3, overlap=0.0)[1] == pytest.approx(comm)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        pm.comm_exposed(sizes, 2, a, b, 10e-3, overlap=70)


def test_bucket_size_changes_the_calculator():
    small = pm.calculator_text(bucket_mb=1)
    default = pm.calculator_text(bucket_mb=25)
    huge = pm.calculator_text(bucket_mb=400)
    assert len({small, default, huge}) == 3
    # one huge bucket: the whole all-reduce waits for the end of backward
    whole = pm.cluster(25.6e6, 8, "100 Gb/s Ethernet", 200, 1.0, bucket_mb=400)
    assert whole["buckets"] == 2 and whole["exposed_ms"] > 0.9 * whole["comm_ms"]


def test_calculator_widgets_start_at_the_codes_values():
    pytest.importorskip("ipywidgets")
    box = pm.calculator(params=25.6e6, n=8, compute_ms=200.0, overlap=0.7, bucket_mb=25.0)
    w = {c.description: c for c in box.children if getattr(c, "description", "")}
    for name, value in (("params", 25.6e6), ("bucket MB", 25.0)):
        s = w[name]
        assert s.value == pytest.approx(value)
        k = (math.log(s.value, s.base) - s.min) / s.step       # the browser snaps to min + k*step
        assert k == pytest.approx(round(k), abs=1e-6), (name, k)
    out = box.children[-1]
    before = out.value
    w["bucket MB"].value = 1.0
    assert out.value != before and " buckets," in out.value


# ---- a GPU trace, in the JSON kineto writes (torch.profiler with ProfilerActivity.CUDA) ----------

MAIN, ENGINE, PID = 1000, 1001, 1000     # main Python thread; autograd engine's thread for cuda:0


def cpu(name, ts, dur, tid=MAIN, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur, "args": args}


def launch(ts, corr, tid=MAIN, name="cudaLaunchKernel"):
    return cpu(name, ts, 10, tid=tid, cat="cuda_runtime", correlation=corr, cbid=211)


def kernel(name, ts, dur, corr, stream=7, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": 0, "stream": stream, "correlation": corr}}


def gpu_trace():
    """One step (us): CPU marks on the main thread; backward's launches and the NCCL enqueues on
    the engine's thread; kernels on stream 7, NCCL kernels on stream 20. The optimizer's kernel
    runs after the CPU step closed (launches are asynchronous)."""
    p, nccl = profiling.PREFIX, "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    ev = [cpu(p + "step", 0, 8500, cat="user_annotation"), cpu(p + "data", 0, 500, cat="user_annotation"),
          launch(100, 1, name="cudaMemcpyAsync"), kernel("Memcpy HtoD (Pageable -> Device)", 200, 100, 1, cat="gpu_memcpy"),
          cpu(p + "forward", 500, 1500, cat="user_annotation"), launch(600, 2),
          kernel("sm90_xmma_gemm_f32f32_tf32f32", 700, 1000, 2),
          {**kernel(p + "forward", 700, 1000, 0), "cat": "gpu_user_annotation"},
          cpu(p + "backward", 2000, 6000, cat="user_annotation"),
          cpu("autograd::engine::evaluate_function: AddmmBackward0", 2050, 150, tid=ENGINE), launch(2100, 3, ENGINE),
          kernel("sm90_xmma_gemm_f32f32_tf32f32", 2200, 2000, 3),
          cpu("nccl:all_reduce", 2300, 50, tid=ENGINE), launch(2320, 4, ENGINE), kernel(nccl, 4200, 1000, 4, stream=20),
          cpu("autograd::engine::evaluate_function: AddmmBackward0", 2400, 150, tid=ENGINE), launch(2450, 5, ENGINE),
          kernel("sm90_xmma_gemm_f32f32_tf32f32", 4200, 2000, 5),
          cpu("nccl:all_reduce", 2580, 50, tid=ENGINE), launch(2600, 6, ENGINE), kernel(nccl, 6200, 1500, 6, stream=20),
          cpu(p + "optimizer", 8000, 500, cat="user_annotation"), launch(8100, 7),
          kernel("multi_tensor_apply_kernel", 8600, 500, 7)]
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100"}],
            "distributedInfo": {"backend": "nccl", "rank": 1, "world_size": 2}, "traceEvents": ev}


def test_budget_reads_gpu_kernels_not_cpu_launches():
    (step,) = profiling.steps(gpu_trace())
    assert step.rank == 1 and set(step.phases) == set(profiling.PHASES)
    assert step.comm == [(4200, 5200), (6200, 7700)]
    assert step.backward_ops  # backward's CPU side comes from the engine's thread, not the main one
    b = profiling.budget(step)
    expected = {"data": 0.1, "forward": 1.0, "backward": 4.0, "optimizer": 0.5, "exposed comm": 1.5,
                "comm": 2.5, "hidden comm": 1.0, "step": 8.9,
                "other": 1.8}  # GPU idle: 300-700, 1700-2200, 7700-8600
    assert {k: round(v * 1e3, 6) for k, v in b.items()} == expected
    assert sum(b[k] for k in profiling.PARTS) == pytest.approx(b["step"])


def test_gpu_step_without_kernels_is_refused_with_the_fix():
    t = gpu_trace()
    t["traceEvents"].append(cpu(profiling.PREFIX + "step", 20000, 1000, cat="user_annotation"))
    first, empty = profiling.steps(t)
    assert profiling.budget(first)["step"] > 0
    with pytest.raises(ValueError, match="record_function"):
        profiling.budget(empty)


def test_untraced_gpu_steps_wait_for_the_kernels(monkeypatch):
    """A CUDA step returns at launch: nb08_profile.timed must synchronize before reading the clock."""
    import types

    import torch

    from ddp_lab.experiments import nb08_profile

    calls = []
    monkeypatch.setattr(nb08_profile, "train_step", lambda *a, **kw: calls.append("step"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **kw: calls.append("sync"))
    ctx = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert len(nb08_profile.timed(None, None, None, ctx, 3)) == 3
    assert calls == ["step", "sync"] * 3
    calls.clear()
    nb08_profile.timed(None, None, None, types.SimpleNamespace(device=torch.device("cpu")), 2)
    assert calls == ["step", "step"]
