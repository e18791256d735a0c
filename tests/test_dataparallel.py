"""ddp_lab.dataparallel: the CPU re-enactment of DataParallel and the byte counts; notebook 01's probe."""
import os

import pytest
import torch
import torch.nn.functional as F

from ddp_lab import dataparallel as dpm
from ddp_lab import launch, models


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


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_dp_step_gradient_is_the_big_batch_gradient(n):
    x, y = batch(60)  # 60 does not divide by 7: unequal chunks must still be right
    torch.manual_seed(0)
    model = models.mlp()
    expected = reference_grads(model, x, y)
    step = dpm.dp_step(model, x, y, n)
    for p, g in zip(model.parameters(), expected):
        assert torch.allclose(p.grad, g, atol=1e-6)
    assert set(step.pids) == {os.getpid()} and len(set(step.threads)) == n
    assert step.loss == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-5)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_dp_traffic_matches_the_formula(n):
    x, y = batch(64)
    torch.manual_seed(0)
    model = models.mlp()
    step = dpm.dp_step(model, x, y, n)
    P = sum(p.nbytes for p in model.parameters())
    device, through = step.traffic.busiest()
    assert through == round(dpm.dp_bytes(n, P, x.nbytes, 64 * 10 * 4))
    assert n == 1 or device == 0
    assert step.traffic.by_phase.get("replicate weights", 0) == (n - 1) * P


def test_dp_counts_buffers_of_batchnorm():
    x, y = batch(32)
    torch.manual_seed(0)
    model = models.cnn(batch_norm=True, channels=4)
    step = dpm.dp_step(model, x, y, 2)
    P = sum(p.nbytes for p in model.parameters())
    B = sum(b.nbytes for b in model.buffers())
    assert B > 0 and step.traffic.by_phase["replicate weights"] == P + B


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


def test_nb01_probe_records_the_lessons_claims():
    run = launch.torchrun("-m ddp_lab.experiments.nb01_ddp_checks", nproc=2, stream=False, timeout=300)
    seeds = {r["rank"]: r for r in run.select(kind="seed")}
    assert seeds[0]["before"] != seeds[1]["before"] and seeds[0]["after"] == seeds[1]["after"]
    grads = {r["rank"]: torch.tensor(r["grad"]) for r in run.select(kind="grad")}
    assert torch.equal(grads[0], grads[1])
    bn = {r["mode"]: r for r in run.select(kind="bn", rank=0)}
    assert max(bn["no_broadcast"]["gaps"]) > 0 and not any(bn["broadcast"]["gaps"])
    timing = run.select(kind="timing")
    assert {r["model"] for r in timing} == {"cnn", "wide_mlp"}
    assert all(r["grad_bytes"] == 4 * r["params"] and r["step_s"] > 0 for r in timing)
    assert len(run.select(kind="baseline")) == 2
