"""replica_check and the gradient-norm NaN guard on 2 gloo ranks, without the notebook's probe.

This file is also the program: the fixture launches it on 2 ranks with the workbook's launcher;
each rank runs every scenario (each on its own DDP model) and records what it saw. A healthy
BatchNorm model under DDP's default buffer broadcast must raise no alarm; with
broadcast_buffers=False the drifting buffers must be named.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.engine import launch, runtime
from ddp_lab.lessons.troubleshooting import replica_check

WORLD = 2
BN_BUFFERS = ["1.running_mean", "1.running_var"]


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)     # each rank its own data
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def train(model, rank, steps, nan_at=None):
    """SGD steps with the gradient-norm guard; returns the steps this rank skipped."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    skipped = []
    for s in range(steps):
        x, y = batch(rank, s)
        if (rank, s) == nan_at:
            x[0, 0] = float("nan")
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
        if torch.isfinite(norm):
            optimizer.step()
        else:
            skipped.append(s)
    return skipped


def scenarios(rank):
    out = {}
    model = DDP(bn_model())                                    # buffers broadcast: the default
    train(model, rank, 5)
    out["default"] = vars(replica_check(model))
    out["default_all_buffers"] = vars(replica_check(model, buffers=True))
    model = DDP(bn_model(), broadcast_buffers=False)
    train(model, rank, 5)
    out["no_broadcast"] = vars(replica_check(model))
    plain = bn_model()                                        # a plain module: its buffers count
    plain.train()(batch(rank, 0)[0])
    out["plain"] = vars(replica_check(plain))
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    out["nan_skipped"] = train(model, rank, 3, nan_at=(1, 1))
    out["nan_params_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    out["nan_replicas"] = vars(replica_check(model))
    return out


@pytest.fixture(scope="module")
def seen():
    run = launch.torchrun(__file__, nproc=WORLD, timeout=240, stream=False)
    return [r for r in sorted(run.select(kind="replicas"), key=lambda r: r["rank"])]


def test_healthy_batchnorm_under_default_ddp_raises_no_alarm(seen):
    for rank in range(WORLD):
        assert seen[rank]["default"]["ok"], seen[rank]["default"]
        assert set(BN_BUFFERS) <= set(seen[rank]["default"]["unchecked"])
        # the running statistics do differ after a step: the default's silence is the skip, not luck
        assert seen[rank]["default_all_buffers"]["differing_tensors"] == BN_BUFFERS


def test_without_buffer_broadcast_the_drifting_buffers_are_named(seen):
    for rank in range(WORLD):
        report = seen[rank]["no_broadcast"]
        assert not report["ok"] and report["differing_ranks"] == [1]
        assert report["differing_tensors"] == BN_BUFFERS and report["unchecked"] == []


def test_a_plain_module_has_its_buffers_compared(seen):
    assert seen[0]["plain"]["differing_tensors"] == BN_BUFFERS


def test_grad_norm_guard_skips_the_poisoned_step_on_every_rank(seen):
    assert [seen[r]["nan_skipped"] for r in range(WORLD)] == [[1]] * WORLD
    for rank in range(WORLD):
        assert seen[rank]["nan_params_finite"] and seen[rank]["nan_replicas"]["ok"]


def test_bad_buffers_argument_names_the_choices():
    with pytest.raises(ValueError, match="None .*True or False"):
        replica_check(nn.BatchNorm1d(3), buffers="auto")


if __name__ == "__main__":
    with runtime.distributed() as ctx:
        ctx.record(kind="replicas", **scenarios(ctx.rank))
