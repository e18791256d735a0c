"""Bad input to scripts/train_ddp.py: one clear message, a non-zero exit, nothing overwritten."""
import shutil
import subprocess
import sys

import pytest

from conftest import PROGRAMS
from ddp_lab.engine import launch

SCRIPT = launch.script("train_ddp.py")


def run(*args, cwd):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    """A real checkpoint (mlp, 2 steps) to be copied into each test's --ckpt-dir."""
    d = tmp_path_factory.mktemp("good")
    proc = run("--max-steps", 2, "--ckpt-dir", d / "ck", cwd=d)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return d / "ck" / "last.pt"


@pytest.fixture
def ckpt_dir(tmp_path, good_ckpt):
    d = tmp_path / "ck"
    d.mkdir()
    shutil.copy(good_ckpt, d / "last.pt")
    return d


def assert_clean_failure(proc, ckpt_dir, good_ckpt, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    # the existing checkpoint is untouched and nothing else was written next to it
    assert (ckpt_dir / "last.pt").read_bytes() == good_ckpt.read_bytes()
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.pt"]


def test_missing_data_folder(tmp_path, ckpt_dir, good_ckpt):
    proc = run("--dataset", "imagefolder", "--data-dir", tmp_path / "nowhere", "--ckpt-dir", ckpt_dir, cwd=tmp_path)
    assert_clean_failure(proc, ckpt_dir, good_ckpt, "nowhere", "train/", "DATA_DIR/train/CLASS")


def test_checkpoint_from_another_model(tmp_path, ckpt_dir, good_ckpt):
    proc = run("--model", "cnn", "--max-steps", 2, "--ckpt-dir", ckpt_dir, cwd=tmp_path)
    assert_clean_failure(proc, ckpt_dir, good_ckpt, "--model mlp", "--model cnn", "--resume none")


def test_checkpoint_from_same_model_other_layers(tmp_path, ckpt_dir, good_ckpt):
    proc = run("--hidden", 32, "--max-steps", 2, "--ckpt-dir", ckpt_dir, cwd=tmp_path)
    assert_clean_failure(proc, ckpt_dir, good_ckpt, "does not fit", "--resume none")


def test_sync_bn_without_cuda(tmp_path, ckpt_dir, good_ckpt):
    proc = run("--model", "cnn", "--batch-norm", "--sync-bn", "--device", "cpu", "--ckpt-dir", ckpt_dir, cwd=tmp_path)
    assert_clean_failure(proc, ckpt_dir, good_ckpt, "--sync-bn needs CUDA", "drop --sync-bn")


@pytest.mark.parametrize("flag", ["--batch-size", "--accum-steps"])
def test_batch_size_below_one(tmp_path, ckpt_dir, good_ckpt, flag):
    proc = run(flag, 0, "--ckpt-dir", ckpt_dir, cwd=tmp_path)
    assert_clean_failure(proc, ckpt_dir, good_ckpt, f"{flag} must be at least 1 (got 0)")


def test_unwritable_checkpoint_folder(tmp_path, ckpt_dir, good_ckpt):
    blocker = tmp_path / "a_file"  # a folder under a regular file cannot exist, even for root
    blocker.write_text("not a folder")
    proc = run("--max-steps", 2, "--ckpt-dir", blocker / "ck", cwd=tmp_path)
    assert_clean_failure(proc, ckpt_dir, good_ckpt, "is not writable", "choose a folder you can write")
    assert blocker.read_text() == "not a folder"


def test_more_ranks_than_samples(tmp_path, ckpt_dir, good_ckpt):
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun("train_ddp.py", nproc=2, stream=False, args=[
            "--dataset", "synthetic", "--synthetic-size", 1, "--synthetic-shape", "1,2,2",
            "--ckpt-dir", ckpt_dir])
    run_ = info.value.run
    assert run_.returncode != 0
    # one message, from rank 0; no traceback from any rank
    errors = [(r, l) for r, lines in run_.rank_lines.items() for l in lines if l.startswith("error: ")]
    assert len(errors) == 1 and errors[0][0] == 0, errors
    assert "2 ranks but only 1 training samples" in errors[0][1] and "use fewer processes" in errors[0][1]
    assert not any("Traceback" in l for lines in run_.rank_lines.values() for l in lines)
    assert (ckpt_dir / "last.pt").read_bytes() == good_ckpt.read_bytes()


def test_bad_flag_under_torchrun_is_rank_0s_one_line_and_exit_code_2(tmp_path):
    # rank 0 starts 3 s late: a rank that exited at once would get rank 0 killed before it could speak
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(PROGRAMS / "step_probe.py", nproc=2, stream=False, env={"RANK0_LATE_S": "3"},
                        args=["train_ddp.py", "--batch-size", 0])
    run_ = info.value.run
    assert run_.returncode == 1  # torchrun's own status whenever a worker fails
    errors = [(r, l) for r, lines in run_.rank_lines.items() for l in lines if l.startswith("error")]
    assert errors == [(0, "error: --batch-size must be at least 1 (got 0)")]
    # torchrun's summary: the root cause is rank 0, with the script's exit code
    root = run_.log[run_.log.index("Root Cause"):]
    assert "rank      : 0 (local_rank: 0)" in root and "exitcode  : 2 " in root, root


def test_a_torch_older_than_the_floor_is_refused_with_the_fix(monkeypatch):
    """The floor the script was tried on (2.4.1 ran every flag, 2.3 failed): an older torch gets one
    error naming the fix, before anything starts; the floor agrees with the doctor's (ddp_lab)."""
    import importlib.util
    from ddp_lab import SCRIPTS_TORCH_FLOOR
    from ddp_lab.engine import launch
    spec = importlib.util.spec_from_file_location("train_floor", launch.script("train_ddp.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.TORCH_FLOOR == SCRIPTS_TORCH_FLOOR
    monkeypatch.setattr(mod.torch, "__version__", "2.3.1+cu121")
    with pytest.raises(mod.UsageError, match=r"torch 2.3.1\+cu121 is older .* pip install 'torch>=2.4'"):
        mod.validate(mod.parse_args([]))
    monkeypatch.setattr(mod.torch, "__version__", "2.4.1")
    mod.validate(mod.parse_args([]))
