"""ddp_lab.lessons.sampling, notebook 02's probes and the DataLoader measurement."""
import math
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from ddp_lab.engine import launch
from ddp_lab.lessons import loading, models, sampling
from ddp_lab.lessons.data import digits_tensors


@pytest.mark.parametrize("n,W", [(10, 4), (297, 2), (8, 8), (3, 5)])
def test_shard_indices_pads_or_drops_to_equal_counts(n, W):
    padded = sampling.shard_indices(n, W)
    assert {len(s) for s in padded} == {math.ceil(n / W)}
    assert set(sum(padded, [])) == set(range(n))
    dropped = sampling.shard_indices(n, W, drop_last=True)
    assert {len(s) for s in dropped} == {n // W}
    assert len(set(sum(dropped, []))) == len(sum(dropped, []))  # no duplicates


def test_set_epoch_changes_the_order_and_keeps_the_partition():
    a = sampling.shard_indices(20, 2, shuffle=True, epoch=0)
    b = sampling.shard_indices(20, 2, shuffle=True, epoch=1)
    assert a != b and a == sampling.shard_indices(20, 2, shuffle=True, epoch=0)
    assert sorted(sum(b, [])) == list(range(20))


def test_exact_shards_cover_once():
    shards = [sampling.exact_shard(297, r, 4) for r in range(4)]
    assert sorted(sum(shards, [])) == list(range(297))


def test_evaluate_world_of_one_matches_direct_computation():
    X, y = digits_tensors("val")
    torch.manual_seed(0)
    model = models.mlp()
    result = sampling.evaluate_distributed(model, X, y, batch_size=50)
    with torch.no_grad():
        logits = model(X)
    assert result["count"] == len(y)
    assert result["accuracy"] == (logits.argmax(1) == y).sum().item() / len(y)
    assert result["loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)


def plan(lengths, B, W, epoch=0, seed=0):
    samplers = [sampling.LengthBalancedSampler(lengths, B, W, r, seed=seed) for r in range(W)]
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers]


@pytest.mark.parametrize("n,B,W", [(256, 8, 2), (37, 4, 3), (50, 2, 4)])
def test_balanced_sampler_is_complete_and_even(n, B, W):
    lengths = torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(n))
    p = plan(lengths, B, W)
    assert len({len(r) for r in p}) == 1 and len(p[0]) == math.ceil(n / (B * W))
    assert all(len(b) == B for r in p for b in r)
    flat = [i for r in p for b in r for i in b]
    assert set(flat) == set(range(n)) and len(flat) - n == len(p[0]) * B * W - n
    assert p == plan(lengths, B, W) and p != plan(lengths, B, W, epoch=1)


def test_balanced_sampler_balances_padded_cost():
    lengths = sampling.sequence_lengths()
    B, W = 8, 2
    naive = []
    for r in range(W):
        idx = list(DistributedSampler(range(len(lengths)), num_replicas=W, rank=r, shuffle=True, seed=0))
        naive.append([idx[i:i + B] for i in range(0, len(idx), B)])

    def gap(p):
        costs = [[sampling.padded_cost(lengths, b) for b in step] for step in zip(*p)]
        return sum(max(c) - min(c) for c in costs)
    assert gap(plan(lengths, B, W)) < 0.5 * gap(naive)


def test_balanced_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        sampling.LengthBalancedSampler([3, 4], 1, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="batch_size"):
        sampling.LengthBalancedSampler([3, 4], 0, num_replicas=1, rank=0)


def test_loader_measurement_delivers_the_same_data_from_workers():
    results = {r["config"]: r for r in loading.measure_all()}
    expected = sorted(list(range(loading.SAMPLES)) * loading.EPOCHS)
    assert all(sorted(r["indices"]) == expected for r in results.values())
    assert results["num_workers=0"]["loader_pids"] == [os.getpid()]
    assert len(results["+ persistent_workers"]["loader_pids"]) == 2
    assert os.getpid() not in results["num_workers=2"]["loader_pids"]


def test_nb02_probe_exact_eval_equals_one_process():
    torch.manual_seed(0)
    model = models.mlp()
    path = os.path.join(tempfile.mkdtemp(), "mlp.pt")
    torch.save(model.state_dict(), path)
    run = launch.torchrun(f"-m ddp_lab.experiments.nb02_metrics {path}", nproc=2, stream=False, timeout=300)
    X, y = digits_tensors("val")
    single = sampling.evaluate_distributed(model, X, y)
    ev = run.select(kind="eval", rank=0)[0]
    assert ev["exact_count"] == 297 and ev["padded_count"] == 298
    assert ev["exact_accuracy"] == single["accuracy"]
    loss = run.select(kind="loss", rank=0)[0]
    assert loss["sum_over_count"] == pytest.approx(single["loss"], rel=1e-6)
    steps = run.select(kind="steps")
    assert {r["sampler"] for r in steps} == {"DistributedSampler", "LengthBalancedSampler"}
