"""ddp-lab verify on what must not depend on the world size: the gradient of step 1 against a 1-rank
run on the same batches (--scaling), LR scheduler steps per optimizer step, an all-reduced evaluation
count that includes DistributedSampler's padding.

First the checks on records made here (no launch; the shard sizes come from torch's own
DistributedSampler), then one verify (a 2-rank launch and a 1-rank launch) of
tests/verify_scripts/bad_world_size.py, which has all three bugs, each at its own line. The clean
scripts stay clean: tests/test_verify.py and test_verify_new.py run them with these checks on."""
import argparse
import json
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from ddp_lab.verify.world import compare, eval_count, lr_per_step, same_noise

HERE = Path(__file__).parent / "verify_scripts"


# -- grad-scale: step 1 of rank 0 against the 1-rank run -------------------------------------------

def first(local, ref=None, lr=0.1, rounds=1, params="p", batch="b"):
    """(rank 0's step 1 on N ranks, the 1-rank run's step 1) as the observer records them."""
    a = {"kind": "step", "step": 1, "rounds": rounds, "lr": [lr], "pre_params": params, "batch": batch,
         "grad_local": local, "grad": {}, "round_lines": ["train.py:31"]}
    b = {"kind": "step", "step": 1, "rounds": 1, "lr": [0.1], "pre_params": "p", "batch": "b",
         "grad_local": {}, "grad": ref or {"w": 3.0, "b": 0.5, "bn.bias": 4e-8}}
    return a, b


def test_the_same_gradient_on_1_rank_is_checked_and_rounding_noise_is_not_compared():
    found, notes, said = compare(*first({"w": 3.0, "b": 0.5, "bn.bias": 3e-8}), world=2)
    assert found == [] and notes == []
    assert any("grad-scale" in s and "2 parameter tensors, ratio 1.0000" in s for s in said), said
    assert any("learning rate of step 1 on 2 ranks equals" in s for s in said), said


@pytest.mark.parametrize("factor, words", [(2.0, "2 times (the world size)"), (0.5, "1/2 of"), (1.5, "1.5 times")])
def test_a_gradient_off_by_a_factor_is_a_finding_at_the_backward(factor, words):
    found, _, said = compare(*first({"w": 3.0 * factor, "b": 0.5 * factor}), world=2)
    assert [f.category for f in found] == ["grad-scale"] and not any("grad-scale" in s for s in said)
    assert words in found[0].message and found[0].line == "train.py:31" and found[0].step == 1
    assert "drop the factor of the world size" in found[0].fix


@pytest.mark.parametrize("change, why", [
    ({"params": "q"}, "parameters before step 1 differ"),
    ({"batch": "c"}, "did not draw rank 0's batches"),
    ({"rounds": 4}, "4 gradient all-reduces"),
    ({"local": {"w": 6.0, "b": 0.5}}, "differ by more than a factor"),
])
def test_what_cannot_be_compared_is_said_never_a_finding(change, why):
    local = change.pop("local", {"w": 6.0, "b": 1.0})  # 2x: would be a finding if it were compared
    found, notes, said = compare(*first(local, **change), world=2)
    assert found == [] and not any("grad-scale" in s for s in said)
    assert any(n.startswith("grad-scale: not compared") and why in n for n in notes), notes


def test_a_learning_rate_scaled_with_the_world_size_is_a_note():
    found, notes, _ = compare(*first({"w": 3.0, "b": 0.5}, lr=0.2), world=2)
    assert found == [] and any("2x the 1-rank run's" in n and "linear scaling rule" in n for n in notes), notes
    assert compare(*first({"w": 3.0, "b": 0.5}), world=2)[1] == []


# -- lr-per-step: scheduler.step() against optimizer.step() -----------------------------------------

def schedule(calls_per_step, steps=4, at="train.py:36"):
    """One rank's records: `calls_per_step[v]` scheduler.step() calls after optimizer step v."""
    recs = []
    for v in range(steps + 1):
        if v:
            recs.append({"kind": "step", "step": v})
        recs += [{"kind": "sched", "sched": 0, "type": "StepLR", "opt_steps": v, "step": v, "lr": [0.1],
                  "at": at}] * calls_per_step[v]
    return {0: recs}


def test_a_scheduler_stepped_per_micro_batch_is_found_at_its_line():
    found = lr_per_step(schedule([3, 4, 4, 4, 0]), [])
    assert [f.category for f in found] == ["lr-per-step"]
    assert "4 times per optimizer step" in found[0].message and found[0].line == "train.py:36"
    assert found[0].step == 2  # the first step after a whole interval of 4 calls
    records = schedule([3, 4, 4, 4, 0])
    for x in records[0]:
        x["lr"] = [None] if x["kind"] == "sched" else None  # a learning rate that is not a number
    assert "went from" not in lr_per_step(records, [])[0].evidence


@pytest.mark.parametrize("calls", [
    [0, 1, 1, 1, 1],   # once per optimizer step
    [1, 0, 1, 0, 1],   # once per epoch of two steps
    [0, 1, 2, 1, 1],   # one step skipped (a GradScaler's inf): the next interval has 2 calls
    [0, 1, 1, 1, 4],   # after the last step the run stopped: that interval is not whole
])
def test_a_scheduler_stepped_at_most_once_per_step_is_no_finding(calls):
    assert lr_per_step(schedule(calls), []) == []


# -- eval-count: a padded evaluation set counted as if exact ----------------------------------------

def evaluation(n, world, counted, drop_last=False, training=False):
    """Records of `world` ranks: one training pass (loader 0), then an evaluation pass (loader 1) of a
    real DistributedSampler over n samples and an all-reduce of [loss sum, counted(rank's shard)]."""
    records = {}
    for r in range(world):
        s = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=False, drop_last=drop_last)
        order = list(s)
        sampler = {"type": "DistributedSampler", "rank": r, "num_replicas": world, "epoch": 0, "shuffle": False,
                   "drop_last": drop_last, "seed": 0, "total_size": s.total_size, "length": n}
        records[r] = [{"kind": "pass", "loader": 0, "pass": 0, "step": 0, "sampler": {"type": "RandomSampler"}},
                      {"kind": "step", "step": 1},
                      {"kind": "pass", "loader": 1, "pass": 0, "step": 1, "count": len(order), "sampler": sampler},
                      *([{"kind": "step", "step": 2}] if training else []),
                      {"kind": "reduce", "values": [1.5, float(counted(order))], "loader": 1, "pass": 0,
                       "step": 1, "at": "train.py:41"}]
    return records


def test_a_padded_evaluation_count_is_found_at_the_all_reduce():
    found = eval_count(evaluation(21, 2, len), 2, [])
    assert [f.category for f in found] == ["eval-count"] and found[0].line == "train.py:41"
    assert "22 samples where loader 1 has 21" in found[0].message and "1 sample DistributedSampler" in found[0].message


@pytest.mark.parametrize("n, counted, drop_last, training", [
    (21, lambda order: len(set(order)) - (order[-1] == 0), False, False),  # the real samples only
    (22, len, False, False),  # 2 divides 22: no padding
    (21, len, True, False),   # drop_last: nothing repeated
    (21, len, False, True),   # a step ran during that pass: not an evaluation loader
])
def test_an_exact_count_or_no_padding_is_no_finding(n, counted, drop_last, training):
    assert eval_count(evaluation(n, 2, counted, drop_last, training), 2, []) == []


# -- same-noise: the data path draws from a generator in the same state on every rank ---------------

def loading(states, moved=True, training=True, name="torch"):
    """Records of len(states) ranks: a pass of loader 0, its first batch loaded with the generator
    `name` in state states[rank] before (and moved by it, or not), then a step (or none)."""
    other = "random" if name == "torch" else "torch"
    return {r: [{"kind": "pass", "loader": 0, "pass": 0, "step": 0},
                {"kind": "draw", "loader": 0, "pass": 0, "batch": 0, "step": 0, "at": "train.py:36",
                 name: [h, h + "'" if moved else h], other: ["s", "s"]},
                *([{"kind": "step", "step": 1}] if training else [])] for r, h in enumerate(states)}


@pytest.mark.parametrize("name", ["torch", "random"])
def test_the_same_generator_state_drawn_from_on_every_rank_is_found(name):
    found = same_noise(loading(["a", "a"], name=name), 2, [])
    assert [f.category for f in found] == ["same-noise"] and found[0].line == "train.py:36"


@pytest.mark.parametrize("states, moved, training", [
    (["a", "b"], True, True),    # seeded per rank: the ranks draw different numbers
    (["a", "a"], False, True),   # one seed, but loading draws nothing (no augmentation)
    (["a", "a"], True, False),   # no step during the pass: an evaluation loader
])
def test_different_states_no_draw_or_an_evaluation_loader_is_no_finding(states, moved, training):
    assert same_noise(loading(states, moved, training), 2, []) == []


# -- one verify of the script with all three bugs ---------------------------------------------------

@pytest.fixture(scope="module")
def bad_world_size():
    from ddp_lab.verify import command
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--steps", "3", "--scaling", "--pg-timeout", "120", "--timeout", "600", "--",
                              str(HERE / "bad_world_size.py")])
    report = command.report_for(args)
    return json.loads(json.dumps(report.to_dict())), report.text()


def line_of(words):
    lines = (HERE / "bad_world_size.py").read_text().splitlines()
    return f"{HERE / 'bad_world_size.py'}:{next(i for i, x in enumerate(lines, 1) if words in x)}"


@pytest.mark.parametrize("category, words, says", [
    ("grad-scale", "loss.backward()", "2 times (the world size)"),
    ("lr-per-step", "scheduler.step()", "4 times per optimizer step"),
    ("eval-count", "dist.all_reduce(total)", "22 samples where loader 1 has 21"),
    ("same-noise", "for i, (x, y) in enumerate(loader):", "torch's global generator is in the same state"),
])
def test_verify_finds_each_world_size_bug_at_its_line(bad_world_size, category, words, says):
    report, text = bad_world_size
    found = [f for f in report["findings"] if f["category"] == category]
    assert len(found) == 1, text
    assert found[0]["line"] == line_of(words) and says in found[0]["message"], text


def test_the_scaling_run_is_one_more_launch_and_nothing_else_is_found(bad_world_size):
    report, text = bad_world_size
    assert report["status"] == 1 and len(report["findings"]) == 4, text
    assert [(r["ranks"], r["steps"]) for r in report["runs"]] == [(2, 3), (1, 1)], report["runs"]
    limits = " ".join(report["cannot_rule_out"])
    assert "--scaling" not in limits and "a loss scaled wrongly for the accumulation" in limits


# A script that builds a new optimizer and scheduler for each of several runs (notebook 05's LR
# scaling does): freed objects' ids come back, so the recorder must not key its counts by id().
RUNS = """
import gc, json, sys, torch
sys.path.insert(0, sys.argv[1])
import _ddp_lab_verify_world as world
records = []
class Obs:
    steps = 0
    def write(self, record):
        records.append(record)
world.patch(Obs(), lambda fn, *a: fn(*a), lambda: "runs.py:1")
for run in range(6):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for step in range(3):
        p.grad = torch.ones(1)
        opt.step()
        sched.step()
    del p, opt, sched
    gc.collect()
print(json.dumps(records))
"""


def test_schedulers_of_successive_runs_are_told_apart(tmp_path):
    import subprocess
    import sys
    inject = Path(__file__).resolve().parents[1] / "ddp_lab" / "verify" / "_inject"
    out = subprocess.run([sys.executable, "-c", RUNS, str(inject)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    records = [dict(r, rank=0) for r in json.loads(out.stdout)]
    assert len({r["sched"] for r in records}) == 6                      # one number per scheduler
    assert [r["opt_steps"] for r in records] == [1, 2, 3] * 6           # each optimizer counts its own
    assert lr_per_step({0: records + [{"kind": "step"}] * 18}, []) == []


def forwards(states, moved=True):
    """Each rank's first training forward of DDP model 0, from generator state states[rank]."""
    return {r: [{"kind": "forward", "ddp": 0, "forward": 0, "step": 0, "at": "train.py:40",
                 "torch": [h, h + "'" if moved else h]}] for r, h in enumerate(states)}


def test_dropout_masks_drawn_from_the_same_state_on_every_rank_are_found_at_the_forward():
    found = same_noise(forwards(["a", "a"]), 2, [])
    assert [(f.category, f.step, f.line) for f in found] == [("same-noise", 1, "train.py:40")]
    assert "same dropout masks" in found[0].message


@pytest.mark.parametrize("states, moved", [(["a", "b"], True), (["a", "a"], False), (["a"], True)])
def test_a_seed_per_rank_a_forward_without_dropout_or_a_missing_rank_is_no_finding(states, moved):
    assert same_noise(forwards(states, moved), 2, []) == []
