"""scripts/train_ddp.py's task: classification or regression (--task), its targets, loss and metrics in
one class (Task); targets that do not fit refused in one line; a run whose steps go non-finite stopped.

Two short 2-rank launches (gloo, a small synthetic set) train each task; the bad inputs run as one
process, on copies of the script with one line changed, as a user's own data would arrive.
"""
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

from ddp_lab.engine import launch

SCRIPT = Path(launch.script("train_ddp.py"))
DOC = Path(__file__).resolve().parents[1] / "docs" / "train_ddp.md"
# --synthetic-size 424: 424 train, 53 (424 // 8) validation (27 on rank 0, 26 on rank 1: shards of unequal size)
SMALL = ["--dataset", "synthetic", "--synthetic-shape", "8", "--synthetic-size", "424", "--progress", "off"]
STANDARDISE = "        y = ((y - y[:n].mean()) / y[:n].std()).reshape(-1, 1)"
SYNTHETIC_X = "        X = torch.randn(n + n_val, *shape, generator=g)"
TEN_CLASSES = "            return TensorDataset(X[:n], y[:n]), TensorDataset(X[n:], y[n:]), 10\n"


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
    assert "these span 0 to 7" in mod.Task("classification", 3).check_target(folder)
    assert mod.Task("classification", 8).check_target(folder) is None
    pairs = [(torch.zeros(4), 1.5)]  # any Dataset: its first target, batched as the loader does (float64)
    assert "torch.float64" in mod.Task("regression", 1).check_target(pairs)


def test_regression_on_a_classification_dataset_is_refused(tmp_path):
    error = one_error(run(SCRIPT, "--task", "regression", "--dataset", "digits", cwd=tmp_path))
    assert "--dataset digits has class labels" in error and "--task classification" in error


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
    # NaN inputs: every step is skipped; the run ends (--max-steps 2) before --max-skipped-steps is reached
    copy = patched(tmp_path, SYNTHETIC_X, SYNTHETIC_X + ' * float("nan")')
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
