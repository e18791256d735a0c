"""scripts/train_ddp.py's task: classification or regression (--task), its targets, loss and metrics in
one class (Task); targets that do not fit refused in one line; a run whose steps go non-finite stopped.

Two short 2-rank launches (gloo, a small synthetic set) train each task; the bad inputs run as one
process, on copies of the script with one line changed, as a user's own data would arrive.
"""
import collections
import difflib
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset, default_collate

from ddp_lab.engine import launch

SCRIPT = Path(launch.script("train_ddp.py"))
DOC = Path(__file__).resolve().parents[1] / "docs" / "train_ddp.md"
# --synthetic-size 424: 424 train, 53 (424 // 8) validation (27 on rank 0, 26 on rank 1: shards of unequal size)
SMALL = ["--dataset", "synthetic", "--synthetic-shape", "8", "--synthetic-size", "424", "--progress", "off"]
STANDARDISE = "        y = ((y - y[:n].mean()) / y[:n].std()).reshape(-1, 1)"
SYNTHETIC_X = "        X = torch.randn(n + n_val, *shape, generator=g)"
TEN_CLASSES = "            return TensorDataset(X[:n], y[:n]), TensorDataset(X[n:], y[n:]), 10\n"
ONE_OUTPUT = "        return TensorDataset(X[:n], y[:n]), TensorDataset(X[n:], y[n:]), 1\n"
MSE = "        return F.mse_loss(out, y, reduction=reduction)"


def load_module():
    spec = importlib.util.spec_from_file_location("train_ddp_task", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # the script runs main() only under __main__
    return mod


def records(path, kind):
    return [r for r in map(json.loads, Path(path).read_text().splitlines()) if r["kind"] == kind]


def start_line(run):
    (line,) = [line for line in run.rank_lines[0] if line.startswith("world_size=")]
    return line


def patched(tmp_path, old, new):
    """A copy of the script with one line changed (the line must be there exactly once)."""
    source = SCRIPT.read_text()
    assert source.count(old) == 1, old
    copy = tmp_path / "train_copy.py"
    copy.write_text(source.replace(old, new))
    return copy


def run(script, *args, cwd):
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def one_error(proc):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


# ---------------------------------------------------------------- the two tasks on 2 ranks
@pytest.fixture(scope="module")
def regression(tmp_path_factory):
    d = tmp_path_factory.mktemp("regression")
    run_ = launch.torchrun("train_ddp.py", nproc=2, stream=False, args=[
        *SMALL, "--task", "regression", "--epochs", "2", "--log-every", "4",
        "--ckpt-dir", d / "ck", "--metrics-out", d / "m.jsonl"])
    return d, run_


def test_regression_trains_on_two_ranks_and_names_its_outputs(regression):
    d, run_ = regression
    line = start_line(run_)
    assert "(424 train, 53 val, regression, 1 output(s))" in line and "classes" not in line, line
    evals = records(d / "m.jsonl", "eval")
    assert [e["count"] for e in evals] == [53, 53]  # every validation sample, once
    assert all(set(e) >= {"loss", "rmse"} and "acc" not in e for e in evals)
    assert not any(line.startswith("eval") for line in run_.rank_lines.get(1, []))  # rank 0 prints


def test_rmse_is_the_square_root_of_the_global_mean(regression):
    d, _ = regression
    mod = load_module()
    args = mod.parse_args([*SMALL, "--task", "regression"])
    _, val, outputs = mod.build_data(args, 0)
    model = mod.build_model(args, (8,), outputs)
    model.load_state_dict(torch.load(d / "ck" / "last.pt", weights_only=True)["model"])
    x, y = val.tensors
    with torch.no_grad():
        sq = ((model(x) - y) ** 2).double().flatten()
    shards = [sq[r::2] for r in (0, 1)]  # evaluation_loader's split: rank r takes r, r + 2, ...
    rank_mean = sum(s.mean().sqrt().item() for s in shards) / 2  # what a mean of each rank's RMSE gives
    ev = records(d / "m.jsonl", "eval")[-1]
    assert ev["rmse"] == pytest.approx(sq.mean().sqrt().item(), rel=1e-5)
    assert ev["loss"] == pytest.approx(sq.mean().item(), rel=1e-5)
    assert abs(ev["rmse"] - rank_mean) > 1e-4, (ev["rmse"], rank_mean)  # not a mean of the ranks' RMSEs
    # the targets are standardised: predicting the training mean (0) scores about 1; the model learned far better
    assert ev["rmse"] < 0.5 * y.double().pow(2).mean().sqrt().item(), ev


def test_classification_is_the_other_setting(tmp_path):
    m = tmp_path / "m.jsonl"
    run_ = launch.torchrun("train_ddp.py", nproc=2, stream=False, args=[
        *SMALL, "--task", "classification", "--epochs", "1", "--metrics-out", m])
    assert "(424 train, 53 val, 10 classes)" in start_line(run_)
    (ev,) = records(m, "eval")
    assert ev["count"] == 53 and 0 <= ev["acc"] <= 1 and "rmse" not in ev
    assert math.isfinite(ev["loss"]) and records(m, "config")[0]["task"] == "classification"


# ---------------------------------------------------------------- targets that do not fit the task
@pytest.mark.parametrize("old,new,flags,needles", [
    pytest.param(STANDARDISE, STANDARDISE + ".double()", ["--task", "regression"],
                 ["regression targets are torch.float64", "dtype=torch.float32"], id="float64"),
    pytest.param(STANDARDISE, STANDARDISE.replace(".reshape(-1, 1)", ""), ["--task", "regression"],
                 ["shaped (424,) would broadcast", "(N, 1)", "y.reshape(-1, 1)"], id="shaped-N"),
    pytest.param(TEN_CLASSES, TEN_CLASSES.replace(", 10\n", ", 5\n"), [],
                 ["class labels must be in [0, 5)", "these span 0 to 9"], id="labels-out-of-range"),
])
def test_a_target_that_does_not_fit_is_one_line_naming_the_fix(tmp_path, old, new, flags, needles):
    copy = patched(tmp_path, old, new)
    error = one_error(run(copy, *SMALL, *flags, "--max-steps", 1, "--ckpt-dir", tmp_path / "ck", cwd=tmp_path))
    for needle in needles:
        assert needle in error, error
    assert not (tmp_path / "ck" / "last.pt").exists()


def test_bad_labels_under_torchrun_are_rank_0s_one_line(tmp_path):
    copy = patched(tmp_path, TEN_CLASSES, TEN_CLASSES.replace(", 10\n", ", 5\n"))
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(copy, nproc=2, stream=False, args=[*SMALL, "--max-steps", "1"])
    lines = info.value.run.rank_lines
    errors = [(r, line) for r, rank_lines in lines.items() for line in rank_lines if line.startswith("error")]
    assert len(errors) == 1 and errors[0][0] == 0 and "class labels must be in [0, 5)" in errors[0][1], errors
    assert not any("Traceback" in line for rank_lines in lines.values() for line in rank_lines)


def test_check_target_reads_torchvision_style_targets_and_other_datasets():
    mod = load_module()
    folder = type("Folder", (), {"targets": [0, 1, 2, 7]})()  # ImageFolder and CIFAR10 keep .targets
    assert "these span 0 to 7" in mod.Task("classification", 3).check_target("training", folder.targets)
    assert mod.Task("classification", 8).check_target("training", folder.targets) is None
    pairs = [(torch.zeros(4), 1.5)]  # any Dataset: its first samples, batched as the loader does (float64)
    assert "torch.float64" in mod.Task("regression", 1).check_data({"training": pairs}, 1)


def test_regression_on_a_classification_dataset_is_refused(tmp_path):
    error = one_error(run(SCRIPT, "--task", "regression", "--dataset", "digits", cwd=tmp_path))
    assert "--dataset digits has class labels" in error and "--task classification" in error


# ---------------------------------------------------------------- data that cannot train, named before its first use
@pytest.mark.parametrize("old,new,flags,needles", [
    pytest.param(TEN_CLASSES, TEN_CLASSES.replace("TensorDataset(X[n:], y[n:])", "TensorDataset(X[n:n], y[n:n])"),
                 [], ["the validation set has 0 sample(s)", "check its path and split"], id="empty-split"),
    pytest.param(SYNTHETIC_X, SYNTHETIC_X + "\n        X[:, 0] = 1.0\n        X = (X - X.mean(0)) / X.std(0)",
                 [], ["training inputs hold NaN or infinite values", "std.clamp_min"], id="constant-column"),
    pytest.param(STANDARDISE, STANDARDISE + ".repeat(1, 4)", ["--task", "regression"],
                 ["shaped (424, 4) hold 4 value(s) per sample, the model has 1 output(s)", "return 4 from build_data"],
                 id="4-columns-1-output"),
])
def test_data_that_cannot_train_is_one_line_naming_its_fix(tmp_path, old, new, flags, needles):
    copy = patched(tmp_path, old, new)
    error = one_error(run(copy, *SMALL, *flags, "--max-steps", 1, "--ckpt-dir", tmp_path / "ck", cwd=tmp_path))
    for needle in needles:
        assert needle in error, error
    assert "standardise" not in error and "reshape" not in error, error  # not a fix for these
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_three_outputs_for_four_target_columns_names_the_outputs_not_a_reshape():
    mod = load_module()
    y = torch.zeros(10, 4)
    error = mod.Task("regression", 3).check_target("training", y)
    assert "hold 4 value(s) per sample, the model has 3 output(s): return 4 from build_data" in error
    assert "reshape" not in error
    assert "y.reshape(-1, 1)" in mod.Task("regression", 1).check_target("training", torch.zeros(10))


class Pairs(torch.utils.data.Dataset):
    """A Dataset with no .targets (read through its samples), as a user's own data arrives."""

    def __init__(self, xs, ys):
        self.xs, self.ys = xs, ys

    def __len__(self):
        return len(self.xs)

    def __getitem__(self, i):
        return self.xs[i], self.ys[i]


def test_each_check_reads_any_dataset_and_names_its_own_fix():
    mod = load_module()
    task = mod.Task("classification", 3)
    xs = torch.randn(6, 4)
    assert task.check_data({"training": Pairs(xs, [0, 1, 2, 0, 1, 2]), "validation": Pairs(xs[:2], [0, 1])}, 2) is None
    assert task.shape == (4,) and task.example[0].shape == (2, 4)  # the input probe: one sample's shape
    checks = {  # splits -> the words the one line must hold
        "the training set has 0 sample(s)": {"training": Pairs(xs[:0], [])},
        "3 sample(s) for 4 ranks": {"training": Pairs(xs, [0] * 6), "validation": Pairs(xs[:3], [0] * 3)},
        "targets are not numbers: map each label to its class index": {"training": Pairs(xs, ["cat"] * 6)},
        "class labels must be in [0, 3)": {"training": Pairs(xs, [0, 1, 2, 3, 0, 1])},
        "inputs hold NaN or infinite values": {"training": Pairs(xs / torch.tensor([1.0, 1, 1, 0]), [0] * 6)},
        "cannot be batched": {"training": Pairs([torch.zeros(3), torch.zeros(5)], [0, 1])},
    }
    for words, splits in checks.items():
        error = task.check_data(splits, 4 if "4 ranks" in words else 1)
        assert error and words in error and "\n" not in error, (words, error)


class Tagger(torch.nn.Module):
    """A model called with keywords: one prediction per token."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 3)

    def forward(self, tokens, mask):
        return self.out(self.emb(tokens)) * mask.unsqueeze(-1)


def test_the_seam_takes_dict_batches_and_keyword_models():
    mod = load_module()
    task = mod.Task("classification", 3)
    samples = [{"tokens": torch.arange(5) % 10, "mask": torch.ones(5), "labels": torch.arange(5) % 3} for _ in range(4)]
    assert task.check_data({"training": samples, "validation": samples}, 2) is None
    assert task.shape == (("tokens", 5), ("mask", 5))
    batch = task.to_device(task.example, torch.device("cpu"))
    out = task.forward(Tagger(), batch)
    assert out.shape == (2, 5, 3) and task.target(batch).shape == (2, 5)
    assert task.check_output(Tagger(), torch.device("cpu")) is None
    sums = task.sums(out, task.target(batch))  # [loss sum, correct, targets, samples]: 10 tokens, 2 samples
    assert sums[2:].tolist() == [10, 2]
    per_sequence = [dict(s, labels=torch.tensor(1)) for s in samples]  # one label per sequence, an output per token
    task.check_data({"training": per_sequence}, 1)
    assert "shaped (2, 5, 3) for targets shaped (2,)" in task.check_output(Tagger(), torch.device("cpu"))


def test_to_device_keeps_named_tuples_lists_and_dicts():
    # default_collate keeps a namedtuple sample a namedtuple; rebuilding one needs its fields by position
    Sample = collections.namedtuple("Sample", "x y")
    task = load_module().Task("classification", 3)
    batch = default_collate([Sample(torch.ones(2), torch.tensor(1)), Sample(torch.zeros(2), torch.tensor(0))])
    moved = task.to_device(batch, torch.device("cpu"))
    assert type(moved) is Sample and torch.equal(moved.x, batch.x) and task.target(moved).tolist() == [1, 0]
    nested = task.to_device({"a": [torch.ones(1), (torch.zeros(1), "text")]}, torch.device("cpu"))
    assert isinstance(nested["a"], list) and isinstance(nested["a"][1], tuple) and nested["a"][1][1] == "text"


def test_evaluate_sizes_its_sums_from_the_task(tmp_path):
    import torch.distributed as dist
    mod = load_module()

    class FiveSums(mod.Task):  # a metric of its own: the mean absolute error, from one more sum
        def sums(self, out, y):
            return torch.cat([super().sums(out, y), (out - y).abs().sum().double().reshape(1)])

        def metrics(self, stats):
            return {**super().metrics(stats[:3]), "mae": (stats[3] / stats[1]).item()}

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        x, y = torch.randn(20, 4), torch.randn(20, 1)
        model = torch.nn.Linear(4, 1)
        loader = mod.evaluation_loader(TensorDataset(x, y), 0, 1, 0, torch.device("cpu"))
        scores = mod.evaluate(model, loader, torch.device("cpu"), None, FiveSums("regression", 1))
    finally:
        dist.destroy_process_group()
    with torch.no_grad():
        assert scores["mae"] == pytest.approx((model(x) - y).abs().mean().item(), rel=1e-6)
        assert scores["rmse"] == pytest.approx((model(x) - y).pow(2).mean().sqrt().item(), rel=1e-6)
    assert scores["count"] == 20


# ---------------------------------------------------------------- the non-finite guard stops the run
def test_an_unscaled_target_stops_after_k_skipped_steps(tmp_path):
    # the synthetic targets in their own units (mean 40, std 8): SGD diverges within a few steps
    copy = patched(tmp_path, STANDARDISE, "        y = y.reshape(-1, 1)")
    m, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    error = one_error(run(copy, *SMALL, "--task", "regression", "--log-every", 1, "--metrics-out", m,
                          "--ckpt-dir", ck, "--save-every", 1000, cwd=tmp_path))
    assert "3 optimizer step(s) in a row skipped" in error and "standardise" in error, error
    train = records(m, "train")
    assert [r["skipped"] for r in train[-3:]] == [True] * 3 and not train[-4]["skipped"], train
    assert error.split("up to step ")[1].startswith(f"{train[-1]['step']}:")
    assert not records(m, "final") and not (ck / "last.pt").exists()  # no checkpoint of the diverged run


def test_a_run_that_trained_nothing_never_exits_0(tmp_path):
    # a loss that is NaN on every step: every step is skipped; the run ends (--max-steps 2) before
    # --max-skipped-steps is reached
    copy = patched(tmp_path, MSE, MSE.replace("reduction=reduction)", 'reduction=reduction) * float("nan")'))
    error = one_error(run(copy, *SMALL, "--task", "regression", "--max-steps", 2, cwd=tmp_path))
    assert "2 optimizer step(s) in a row skipped, up to step 2" in error, error


def test_max_skipped_steps_must_be_at_least_one(tmp_path):
    error = one_error(run(SCRIPT, "--max-skipped-steps", 0, cwd=tmp_path))
    assert error == "error: --max-skipped-steps must be at least 1 (got 0)"


# ---------------------------------------------------------------- docs/train_ddp.md's regression recipe
def recipe() -> tuple[str, str]:
    """(the doc's section "Adapt it to a regression task", the script with its ```diff blocks applied)."""
    text = DOC.read_text()
    start = text.index("\n### Adapt it to a regression task")
    section = text[start:text.index("\n## ", start)]
    source = SCRIPT.read_text()
    for indent, body in re.findall(r"^( *)```diff\n(.*?)^\1```", section, re.S | re.M):
        old, new = [], []
        for line in (line[len(indent):] for line in body.splitlines()):
            mark, text_ = (line[:1], line[1:]) if line else (" ", "")
            assert mark in " +-", line
            old += [text_] if mark != "+" else []
            new += [text_] if mark != "-" else []
        old_text, new_text = "\n".join(old) + "\n", "\n".join(new) + "\n"
        assert source.count(old_text) == 1, f"the recipe's block does not match the script once:\n{old_text}"
        source = source.replace(old_text, new_text)
    return section, source


def test_the_regression_recipe_trains_diabetes_in_the_lines_it_states(tmp_path):
    section, source = recipe()
    diff = difflib.unified_diff(SCRIPT.read_text().splitlines(), source.splitlines(), n=0, lineterm="")
    changed = sum(1 for d in diff if d[:1] in "+-" and not d.startswith(("+++", "---")) and d[1:].strip())
    assert re.findall(r"edits change (\d+) lines", section) == [str(changed)]
    (tmp_path / "train_diabetes.py").write_text(source)
    m = tmp_path / "m.jsonl"
    proc = run(tmp_path / "train_diabetes.py", "--epochs", 2, "--progress", "off", "--metrics-out", m, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dataset=diabetes (354 train, 88 val, regression, 1 output(s))" in proc.stdout
    ev = records(m, "eval")[-1]
    # standardised targets: the training mean scores about 1; 10 measurements explain part of the rest
    assert ev["count"] == 88 and ev["rmse"] < 0.85, ev
