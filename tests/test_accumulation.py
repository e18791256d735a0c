"""ddp_lab.accumulation: equivalence, no_sync counting (1 and 2 ranks), AMP + accumulation, LR."""
import pytest
import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab import accumulation as A
from ddp_lab import data, launch, models, runtime


def test_effective_batch_and_linear_scaling():
    assert A.effective_batch(32, 8, 4) == 1024
    assert A.scaled_lr(0.1, 256, 32, 8, 4) == pytest.approx(0.4)


def test_k_micro_batches_equal_one_big_batch():
    X, Y = data.digits_tensors("train")
    x, y = X[:64], Y[:64]
    torch.manual_seed(0)
    big = A.accumulated_grads(models.mlp(), x, y, 1)
    torch.manual_seed(0)
    acc = A.accumulated_grads(models.mlp(), x, y, 4)
    torch.manual_seed(0)
    undivided = A.accumulated_grads(models.mlp(), x, y, 4, divide=False)
    for g_big, g_acc, g_raw in zip(big, acc, undivided):
        torch.testing.assert_close(g_acc, g_big, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(g_raw, 4 * g_big, rtol=1e-5, atol=1e-6)


def _window(model, acc, x, y, how):
    for xb, yb in zip(x.chunk(acc.accumulation_steps), y.chunk(acc.accumulation_steps)):
        if how == "seed":
            acc.step(F.cross_entropy(model(xb), yb))
        elif how == "fixed":
            with acc.sync_context():
                acc.step(F.cross_entropy(model(xb), yb))
        else:
            loss = F.cross_entropy(model(xb), yb)
            with acc.sync_context():
                acc.step(loss)


def test_counter_sees_one_all_reduce_per_window_only_with_forward_inside_no_sync():
    X, Y = data.digits_tensors("train")
    calls = {}
    with runtime.distributed():  # a world of one: DDP still runs its reducer and the hook
        for how in ("seed", "fixed", "backward_only"):
            torch.manual_seed(0)
            model = DDP(models.mlp())
            counter = A.AllReduceCounter(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            cls = A.SeedGradientAccumulator if how == "seed" else A.GradientAccumulator
            acc = cls(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), accumulation_steps=4)
            for w in range(3):
                _window(model, acc, X[w * 64:(w + 1) * 64], Y[w * 64:(w + 1) * 64], how)
            calls[how] = counter.calls
    assert calls == {"seed": 12, "fixed": 3, "backward_only": 12}


def test_two_ranks_fixed_accumulator_saves_k_minus_one_of_k_all_reduces():
    run = launch.torchrun("-m ddp_lab.experiments.nb05_nosync", nproc=2, stream=False,
                          args=["--model", "mlp", "--updates", "2", "--accum-steps", "4"])
    rows = {(r["variant"], r["rank"]): r for r in run.select(kind="variant")}
    for rank in (0, 1):
        seed, fixed, bwd = (rows[(v, rank)] for v in ("seed", "fixed", "backward_only"))
        assert fixed["calls"] == 2 * fixed["buckets"]
        assert seed["calls"] == bwd["calls"] == 4 * fixed["calls"]
        assert all(r["diff_to_rank0"] == 0.0 for r in (seed, fixed, bwd))
        assert fixed["diff_to_seed"] < 1e-5


def test_amp_accumulation_skips_whole_window_and_scale_moves_only_at_boundaries():
    trace, grads, reference = A.amp_accumulation_trace(accumulation_steps=4, windows=4, inf_at=(2, 1))
    for r in trace:
        if not r["boundary"]:
            assert r["scale_after"] == r["scale"]
    ends = [r for r in trace if r["boundary"]]
    assert [r["updated"] for r in ends] == [True, True, False, True]
    assert ends[2]["scale_after"] == ends[2]["scale"] / 2
    for g, ref in zip(grads, reference):
        torch.testing.assert_close(g, ref, rtol=0, atol=1e-3 * ref.abs().max().item())


def test_lr_schedules():
    sched = A.seed_schedule(0.1, world_size=4, warmup_epochs=2, epochs=4, steps_per_epoch=3)
    assert sched == pytest.approx([0.2] * 3 + [0.4] * 6 + [0.4] * 3)
    assert [A.lr_at(s, 1.0, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
