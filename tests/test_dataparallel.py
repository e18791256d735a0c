"""ddp_lab.lessons.dataparallel: the CPU re-enactment of DataParallel and the byte counts (the launch of notebook 01's probe is asserted in the notebook)."""
import os
import threading

import pytest
import torch
import torch.nn.functional as F

from ddp_lab.lessons import dataparallel as dpm
from ddp_lab.lessons import models


def batch(n=60):
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def reference_grads(model, x, y):
    twin = models.mlp()
    twin.load_state_dict(model.state_dict())
    F.cross_entropy(twin(x), y).backward()
    return [p.grad for p in twin.parameters()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="describes the CPU-only behaviour")
def test_dataparallel_without_cuda_is_the_plain_module():
    torch.manual_seed(0)
    report = dpm.dataparallel_on_cpu(models.mlp(), batch()[0])
    assert report["device_ids"] == [] and report["module_is_model"] and report["outputs_equal"]
    assert report["forward_calls"] == 2 and report["same_thread"]


@pytest.mark.parametrize("schedule", dpm.SCHEDULES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_dp_step_gradient_is_the_big_batch_gradient(n, schedule):
    x, y = batch(60)  # 60 does not divide by 7: unequal chunks must still be right
    torch.manual_seed(0)
    model = models.mlp()
    expected = reference_grads(model, x, y)
    step = dpm.dp_step(model, x, y, n, schedule=schedule)
    for p, g in zip(model.parameters(), expected):
        assert torch.allclose(p.grad, g, atol=1e-6)
    assert set(step.pids) == {os.getpid()} and len(set(step.threads)) == n
    assert step.loss == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-5)


def test_dp_step_uses_torch_replicate_and_rebuilds_every_step():
    x, y = batch(32)
    torch.manual_seed(0)
    model = models.mlp()
    first, second = dpm.dp_step(model, x, y, 3), dpm.dp_step(model, x, y, 3)
    own = {id(p) for p in model.parameters()}
    for step in (first, second):
        assert len(step.replicas) == 3 and all(r is not model for r in step.replicas)
        assert all(getattr(r, "_is_replica", False) for r in step.replicas)   # torch's replicate made them
        assert not any(id(t) in own for r in step.replicas for t in r._former_parameters.values())
    assert not any(a is b for a in first.replicas for b in second.replicas)
    assert not model._forward_hooks  # the witnesses did not leak into the model


def test_dp_reduce_runs_once_after_all_of_backward():
    x, y = batch(32)
    torch.manual_seed(0)
    step = dpm.dp_step(models.mlp(), x, y, 4)
    kinds = [what for what, _ in sorted(step.events, key=lambda e: e[1])]
    assert kinds.count("reduce grads onto device 0") == 1 and kinds[-1] == "reduce grads onto device 0"
    assert sum(k.startswith("replica ") for k in kinds) == 4 * 3  # 3 layers with gradients per replica


@pytest.mark.parametrize("n", [2, 4, 8])
def test_dp_link_bytes_by_schedule(n):
    x, y = batch(64)
    torch.manual_seed(0)
    model = models.mlp()
    P = sum(p.nbytes for p in model.parameters())
    wg = ("replicate weights", "reduce grads")
    copies = dpm.dp_step(model, x, y, n, schedule="copies").traffic
    assert copies.through(0, wg) == 2 * (n - 1) * P and copies.busiest(wg)[0] == 0
    piped = dpm.dp_step(model, x, y, n, schedule="pipelined").traffic
    assert piped.through(0, wg) == 2 * P and piped.busiest(wg)[1] <= 4 * P
    assert piped.by_phase["replicate weights"] == copies.by_phase["replicate weights"] == (n - 1) * P


def test_dp_counts_buffers_of_batchnorm():
    x, y = batch(32)
    torch.manual_seed(0)
    model = models.cnn(batch_norm=True, channels=4)
    step = dpm.dp_step(model, x, y, 2)
    P = sum(p.nbytes for p in model.parameters())
    B = sum(b.nbytes for b in model.buffers())
    assert B > 0 and step.traffic.by_phase["replicate weights"] == P + B


def test_replicate_cost_is_measured():
    torch.manual_seed(0)
    model = models.mlp()
    assert dpm.replicate_seconds(model, 4, repeats=2) > 0
    assert dpm.forward_seconds(model, batch(8)[0], repeats=2) > 0


def test_threads_running_python_keep_at_most_one_core_busy():
    threads = torch.get_num_threads()
    busy = dpm.cores_busy(dpm.python_work, n_threads=2, repeats=200)
    assert 0 < busy < 1.1  # one interpreter lock: never two cores, whatever the load
    assert torch.get_num_threads() == threads


def test_another_busy_thread_of_the_process_does_not_count():
    # A thread of this process that computes outside the lock (a kernel, a library's pool)
    # used to add its CPU time to the figure: only the measuring threads count.
    stop = threading.Event()
    a = torch.randn(256, 256)

    def burn():
        while not stop.is_set():
            a @ a

    other = threading.Thread(target=burn, daemon=True)
    other.start()
    try:
        busy = dpm.cores_busy(dpm.python_work, n_threads=2, repeats=200)
    finally:
        stop.set()
        other.join()
    assert 0 < busy < 1.1


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_ring_allreduce_sums_and_counts(n):
    g = torch.Generator().manual_seed(n)
    tensors = [torch.randn(1003, generator=g) for _ in range(n)]
    out, traffic = dpm.ring_allreduce(tensors)
    for o in out:
        assert torch.allclose(o, sum(tensors), atol=1e-5)
    P = 1003 * 4
    for d in range(n):  # every device moves the same amount, up to one float per chunk
        assert abs(traffic.through(d) - dpm.ddp_bytes(n, P)) <= 16 * n
    assert traffic.busiest()[1] <= 4 * P
