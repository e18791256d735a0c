"""ddp-lab verify on small look-alike scripts (tests/verify_scripts/): each broken one is found with
the right category, rank and step, and nothing else; the correct ones give no finding.

One verify per script at --steps 3, all of them run for the module two at a time (a 2-rank launch
costs 8-30 s here, much of it waiting), each parsed from its own `ddp-lab verify` command line.
"""
import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ddp_lab import cli
from ddp_lab.autopsy.collect import INJECT as AUTOPSY_INJECT
from ddp_lab.verify.runner import INJECT as VERIFY_INJECT

HERE = Path(__file__).parent / "verify_scripts"
ROOT = Path(__file__).resolve().parents[1]

# --steps 3 each, except the hang: its rank 1 skips its third batch, so both ranks still reach step 3
OPTIONS = {"bad_nan_skip": ["--pg-timeout", "15", "--timeout", "120"], "uneven_split": ["--uneven"],
           "good_resume": ["--resume"], "bad_resume": ["--resume"]}
NO_STEP_LIMIT = {"bad_nan_skip"}


SCRIPTS = sorted(p.stem for p in HERE.glob("*.py"))


TEXTS = {}  # script name -> the text report of its verify (what `ddp-lab verify` prints without --json)


def _verify(name):
    """(exit status, JSON report) of `ddp-lab verify --json [options] -- tests/verify_scripts/NAME.py`;
    its text report goes to TEXTS."""
    from ddp_lab.verify import command
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    steps = [] if name in NO_STEP_LIMIT else ["--steps", "3"]
    args = parser.parse_args([*steps, *OPTIONS.get(name, []), "--json", "--", str(HERE / f"{name}.py")])
    report = command.report_for(args)
    TEXTS[name] = report.text()
    return report.status, json.loads(json.dumps(report.to_dict()))


@pytest.fixture(scope="module")
def verified():
    """verified(name) -> (exit status, JSON report): every script verified once, two at a time."""
    before = sorted(p.name for p in HERE.iterdir())
    with ThreadPoolExecutor(2) as pool:
        cache = dict(zip(SCRIPTS, pool.map(_verify, SCRIPTS)))
    assert sorted(p.name for p in HERE.iterdir()) == before, "verify wrote into the scripts' folder"
    return cache.__getitem__


def test_the_command_line_reports_what_the_api_does(verified, capsys):
    """The shared runs above go through command.report_for; `ddp-lab verify --json` prints the same."""
    assert cli.main(["verify", "--json", "--steps", "3", "--", str(HERE / "cannot_run.py")]) == 2
    printed = json.loads(capsys.readouterr().out)
    status, report = verified("cannot_run")
    assert status == 2 and printed["findings"] == report["findings"] == []
    # the same error, whichever rank failed first (both fail on the missing file)
    same = [e.split(" failed: ", 1)[1] for e in (printed["error"], report["error"])]
    assert same[0] == same[1] and "data/train.bin" in same[0], (printed["error"], report["error"])


@pytest.mark.parametrize("name", ["good_plain", "good_nanogpt"])
def test_correct_scripts_have_no_findings(verified, name):
    status, report = verified(name)
    assert report["findings"] == [] and status == 0, report
    assert report["runs"] == [{"ranks": 2, "steps": 3, "wall_s": report["runs"][0]["wall_s"], "returncode": 0}]
    assert not [n for n in report["notes"] if "observer failed" in n], report["notes"]


BROKEN = [  # script, category, rank, step, words in the message or evidence
    ("bad_no_sampler", "data-coverage", 1, 1, "every rank draws the same 64 samples"),
    ("bad_set_epoch", "data-coverage", 0, 3, "still has epoch=0"),
    ("bad_seed_split", "data-coverage", 1, 1, "shards overlap"),
    ("bad_local_rank", "data-coverage", 1, 1, "DistributedSampler(rank=0, num_replicas=2) on rank 1"),
    ("bad_bn_buffers", "replica-divergence", 1, 1, "buffers differ from rank 0 after step 1: 1.running_mean"),
    ("bad_lr_rank", "replica-divergence", 1, 1, "learning rates differ: [0.05] on rank 0, [0.1] on rank 1"),
    ("bad_rank0_scheduler", "replica-divergence", 1, 2, "agreed at step 1, then differ"),
    ("bad_accum", "comm-per-step", 0, 1, "4 gradient all-reduces before step 1"),
    ("bad_same_dropout", "same-noise", None, 1, "every rank draws the same dropout masks"),
    ("bad_nan_skip", "hang", 0, 5, "a NaN skip on one rank"),
]


@pytest.mark.parametrize("name,category,rank,step,words", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_script_is_found(verified, name, category, rank, step, words):
    status, report = verified(name)
    assert status == 1, report
    assert [(f["category"], f["rank"], f["step"]) for f in report["findings"]] == [(category, rank, step)], report
    f = report["findings"][0]
    assert words in " ".join([f["message"], f["evidence"], f["fix"]]), f
    assert f["fix"] and f["evidence"]


def test_a_resume_from_a_full_checkpoint_equals_the_uninterrupted_run(verified):
    """Killed by SIGKILL after step 2 (the first step after its first checkpoint), relaunched."""
    status, report = verified("good_resume")
    assert status == 0 and report["findings"] == [], report
    assert [(r["steps"], r.get("what")) for r in report["runs"]] == [
        (3, None), (2, "killed at step 2"), (2, "resumed")]  # the relaunch repeats steps 2 and 3


def test_a_checkpoint_without_the_optimizer_state_is_found(verified):
    status, report = verified("bad_resume")
    assert status == 1 and [(f["category"], f["rank"], f["step"]) for f in report["findings"]] == [
        ("resume-mismatch", 0, 2)], report
    f = report["findings"][0]
    assert "optimizer state before the step" in f["evidence"] and "learning rate" not in f["evidence"], f
    assert "batch" not in f["evidence"] and "optimizer.state_dict()" in f["fix"]


def test_wasted_bytes_of_accumulation_without_no_sync(verified):
    """Linear(8, 1): 9 float32 gradients = 36 bytes per all-reduce; 3 of 4 all-reduces per step wasted."""
    _, report = verified("bad_accum")
    assert "36 bytes per all-reduce; 324 bytes sent for nothing over 3 of 3 steps" in report["findings"][0]["evidence"]


def test_the_hang_is_the_autopsys_diagnosis_at_the_programs_lines(verified):
    _, report = verified("bad_nan_skip")
    f = report["findings"][0]
    assert "bad_nan_skip.py:18" in f["message"] and "bad_nan_skip.py:31" in f["message"], f
    assert "sitecustomize" not in f["message"] + f["evidence"], f  # no frame of the observer is blamed
    assert "`if not torch.isfinite(loss):`" in f["fix"]


def test_three_ranks_expose_an_uneven_split(verified):
    status, report = verified("uneven_split")
    assert [r["ranks"] for r in report["runs"]] == [2, 3]
    assert status == 1 and len(report["findings"]) == 1, report
    f = report["findings"][0]
    assert (f["category"], f["step"]) == ("data-coverage", 1)
    assert f["message"] == "with 3 ranks: 1 of 64 samples are drawn by no rank in pass 0"
    assert "never drawn: [63]" in f["evidence"]


def test_a_script_that_cannot_run_exits_2_with_the_reason(verified):
    status, report = verified("cannot_run")
    assert status == 2 and report["findings"] == []
    assert "data/train.bin" in report["error"] and "FileNotFoundError" in report["error"], report["error"]


def test_no_such_script_exits_2_without_a_launch(tmp_path, capsys):
    assert cli.main(["verify", str(tmp_path / "missing.py")]) == 2
    out = capsys.readouterr().out
    assert "no such file" in out and "missing.py" in out and "in 0." in out


def test_the_observer_chains_with_the_autopsy_and_a_users_sitecustomize(tmp_path):
    """Only one sitecustomize is imported per process: the autopsy's runs ours, ours runs the next."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import builtins\nbuiltins.USER_SITE_RAN = True\n")
    (tmp_path / "verify").mkdir()
    (tmp_path / "autopsy").mkdir()
    probe = ("import builtins, torch.utils.data.dataloader as dl; "
             "print(getattr(builtins, 'USER_SITE_RAN', False), hasattr(dl._BaseDataLoaderIter._reset, '__wrapped__'))")
    env = {**os.environ, "RANK": "0", "DDP_LAB_VERIFY_DIR": str(tmp_path / "verify"),
           "DDP_LAB_AUTOPSY_DIR": str(tmp_path / "autopsy"),
           "PYTHONPATH": os.pathsep.join([str(AUTOPSY_INJECT), str(ROOT), str(VERIFY_INJECT), str(user)])}
    for var in ("DDP_LAB_AUTOPSY_ARMED", "DDP_LAB_VERIFY_PID"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr
    assert (tmp_path / "autopsy" / "rank0.pid").exists()  # the autopsy armed this rank as before


def line_of(name, words):
    """path:line of the first line of tests/verify_scripts/NAME.py that holds `words`."""
    lines = (HERE / f"{name}.py").read_text().splitlines()
    return f"{HERE / name}.py:{next(i for i, x in enumerate(lines, 1) if words in x)}"


def test_findings_name_the_scripts_line(verified):
    _, report = verified("bad_accum")
    (f,) = report["findings"]
    assert f["line"] == line_of("bad_accum", "loss.backward()")  # the backward that all-reduced
    assert f"line: {f['line']}" in TEXTS["bad_accum"] and "the forward too" in f["fix"]
    _, report = verified("bad_set_epoch")
    (f,) = report["findings"]
    assert f["category"] == "data-coverage" and f["line"] == line_of("bad_set_epoch", "in self.loader")


def test_dropout_with_one_seed_is_found_at_the_forward_and_a_seed_per_rank_is_clean(verified):
    """bad_same_dropout: one seed, so the masks are the same on every rank; good_nanogpt seeds with
    1337 + rank after making the data, so its dropout forwards are watched and differ."""
    _, report = verified("bad_same_dropout")
    lines = (HERE / "bad_same_dropout.py").read_text().splitlines()
    forward = next(i for i, x in enumerate(lines, 1) if "model(x)" in x)
    assert report["findings"][0]["line"] == f"{HERE / 'bad_same_dropout.py'}:{forward}", report
    assert "torch.manual_seed(seed + rank)" in report["findings"][0]["fix"]
    status, clean = verified("good_nanogpt")
    assert status == 0 and any("training forwards of the DDP model (dropout)" in c for c in clean["checked"]), clean
