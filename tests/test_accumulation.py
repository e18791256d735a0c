"""ddp_lab.lessons.accumulation: samples per update, equivalence, no_sync counting (1 and 2 ranks), AMP +
accumulation, LR."""
import pytest
import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_lab.lessons import accumulation as A
from ddp_lab.lessons import data, models
from ddp_lab.engine import launch, runtime


def _samples_per_update(per_rank_batch, world_size, accumulation_steps, loop):
    """Samples that went through forward behind each optimizer step, summed over the ranks.

    Each rank is a replica fed its own DistributedSampler shard, run one after the other in this
    process: DDP averages the ranks' gradients, so one update stands on the samples of all of them.
    A forward pre-hook counts the samples, an optimizer hook marks each update."""
    X, Y = data.digits_tensors("train")
    dataset = TensorDataset(X[:1024], Y[:1024])
    totals = None
    for rank in range(world_size):
        torch.manual_seed(0)
        model = models.mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        seen, at_update = [0], []
        model.register_forward_pre_hook(lambda m, args: seen.__setitem__(0, seen[0] + len(args[0])))
        optimizer.register_step_post_hook(lambda opt, args, kwargs: at_update.append(seen[0]))
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        if loop == "survey":
            A.survey_article_loop(model, optimizer, scaler, loader, accumulation_steps)
        else:
            acc = A.GradientAccumulator(model, optimizer, scaler, accumulation_steps=accumulation_steps)
            for x, y in loader:
                with acc.sync_context():
                    acc.step(F.cross_entropy(model(x), y))
        per_update = [b - a for a, b in zip([0] + at_update, at_update)]
        totals = per_update if totals is None else [t + n for t, n in zip(totals, per_update)]
    return totals


@pytest.mark.parametrize("loop", ["accumulator", "survey"])
@pytest.mark.parametrize("per_rank_batch, world_size, accumulation_steps", [(32, 8, 1), (8, 8, 4), (16, 2, 4)])
def test_effective_batch_is_the_samples_behind_each_optimizer_step(per_rank_batch, world_size, accumulation_steps, loop):
    # (32, 8, 1) is the survey article's example: 256 in all is 32 per GPU on 8 GPUs
    updates = _samples_per_update(per_rank_batch, world_size, accumulation_steps, loop)
    assert len(updates) == 1024 // (per_rank_batch * world_size * accumulation_steps) > 1
    assert set(updates) == {A.effective_batch(per_rank_batch, world_size, accumulation_steps)}, updates


def test_scaling_rules():
    assert A.scaled_lr(0.1, 256, 32, 8, 4) == pytest.approx(0.4)
    assert A.scaled_lr(0.1, 256, 32, 8, 4, rule="sqrt") == pytest.approx(0.2)
    assert A.scaled_lr(0.1, 256, 32, 8, 4, rule="none") == pytest.approx(0.1)


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
    batches = list(zip(x.chunk(acc.accumulation_steps), y.chunk(acc.accumulation_steps)))
    if how == "survey":
        A.survey_article_loop(model, acc.optimizer, acc.scaler, batches, acc.accumulation_steps)
        return
    for xb, yb in batches:
        if how == "engineering":
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
        for how in ("engineering", "survey", "fixed", "backward_only"):
            torch.manual_seed(0)
            model = DDP(models.mlp())
            counter = A.AllReduceCounter(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            cls = A.GradientAccumulator if how in ("fixed", "backward_only") else A.ArticleGradientAccumulator
            acc = cls(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), accumulation_steps=4)
            for w in range(3):
                _window(model, acc, X[w * 64:(w + 1) * 64], Y[w * 64:(w + 1) * 64], how)
            calls[how] = counter.calls
    assert calls == {"engineering": 12, "survey": 12, "fixed": 3, "backward_only": 12}


def test_two_ranks_fixed_accumulator_saves_k_minus_one_of_k_all_reduces():
    run = launch.torchrun("-m ddp_lab.experiments.nb05_nosync", nproc=2, stream=False,
                          args=["--model", "mlp", "--updates", "2", "--accum-steps", "4"])
    rows = {(r["variant"], r["rank"]): r for r in run.select(kind="variant")}
    for rank in (0, 1):
        article, survey, fixed, bwd = (rows[(v, rank)] for v in ("engineering", "survey", "fixed", "backward_only"))
        assert fixed["calls"] == 2 * fixed["buckets"]
        assert article["calls"] == survey["calls"] == bwd["calls"] == 4 * fixed["calls"]
        assert all(r["diff_to_rank0"] == 0.0 for r in (article, survey, fixed, bwd))
        assert fixed["diff_to_engineering"] < 1e-5 and survey["diff_to_engineering"] == bwd["diff_to_engineering"] == 0.0


def test_amp_accumulation_skips_whole_window_and_halves_the_scale_once():
    trace, grads, reference = A.amp_accumulation_trace(accumulation_steps=4, windows=4, inf_at=(2, 1))
    ends = [r for r in trace if r["boundary"]]
    assert [r["updated"] for r in ends] == [True, True, False, True]
    assert [r["scale_after"] for r in ends] == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15, 2.0 ** 15]
    for g, ref in zip(grads, reference):
        torch.testing.assert_close(g, ref, rtol=0, atol=1e-3 * ref.abs().max().item())


def test_lr_schedules():
    sched = A.survey_schedule(0.1, world_size=4, warmup_epochs=2, epochs=4, steps_per_epoch=3)
    assert sched == pytest.approx([0.2] * 3 + [0.4] * 6 + [0.4] * 3)
    assert [A.lr_at(s, 1.0, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_lr_scaling_runs_use_the_scaled_rates_and_adam_moves_every_weight_by_lr():
    run = launch.torchrun("-m ddp_lab.experiments.nb05_lr_scaling", nproc=2, stream=False,
                          args=["--epochs", "2", "--warmup-epochs", "1", "--sgd-lr", "0.1", "--adamw-lr", "0.05"])
    runs = {(r["optimizer"], r["rule"], r["warmup_epochs"]): r for r in run.select(kind="run", rank=0)}
    assert len(runs) == 10
    for (opt, rule, warmup), r in runs.items():
        base = 0.1 if opt == "sgd" else 0.05
        assert max(r["lr_used"]) == pytest.approx(base * {"base": 1, "none": 1, "sqrt": 2, "linear": 4}[rule])
        assert r["batch"] == (128 if rule == "base" else 512)
        assert len(r["lr_used"]) == len(r["train_loss"]) == 2 * r["steps_per_epoch"]
    first = runs[("adamw", "linear", 0)]
    assert first["first_move_median"] == pytest.approx(0.2, rel=0.05)  # Adam's first step: lr per weight
    assert runs[("sgd", "linear", 0)]["first_move_median"] < 0.02
