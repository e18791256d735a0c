"""scripts/train_ddp.py --ckpt-format dcp: sharded checkpoints (torch.distributed.checkpoint).

Launches shared by every test, in one module fixture, side by side where they are independent:
- 2 ranks: a straight run of 18 steps, and a crash drill (saved as last.dcp/ and killed at step 9,
  restarted by torchrun, resumed to step 18), both logging every sample index they train on;
- then 3 ranks resume the drill's last.dcp (step 18) and finish the epoch;
- one process: a save killed between its two renames, then --resume auto; the two format
  mix-ups (a .pt file for dcp, a dcp folder for pt); a save that hits a file-size limit; a saved
  folder damaged three ways (a part overwritten, .metadata cut short, another optimizer's run).
"""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ddp_lab.engine import launch

SCRIPT = launch.script("train_ddp.py")
SAMPLE_PROBE = Path(__file__).parent / "programs" / "sample_probe.py"  # logs every sample index used
# One epoch of the 1500 digits, batch 10 per rank: 2 ranks use 20 samples a step, so step 18 is
# sample 360 and the 1140 left split evenly over 3 ranks (no padding copy to count twice).
COMMON = ["--epochs", "1", "--batch-size", "10", "--log-every", "3"]

# Dies like a killed job right before the complete folder is renamed into place: the previous
# checkpoint has been moved aside to last.dcp.old, the new one is still last.dcp.tmp.
DYING_RENAME = """
import os, signal, sys, runpy
real_replace = os.replace
def dying_replace(src, dst):
    if str(src).endswith("last.dcp.tmp"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst)
os.replace = dying_replace
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def one(path, kind):
    (rec,) = [r for r in records(path) if r["kind"] == kind]
    return rec


def run1(*args, cwd, program=None, preexec_fn=None):
    """One process, no torchrun: (exit code, stderr)."""
    argv = [sys.executable, *([program] if program else []), SCRIPT, *map(str, args)]
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, preexec_fn=preexec_fn)
    return proc.returncode, proc.stderr


def drill_then_three(d):
    """The 2-rank crash drill, then 3 ranks on from its last.dcp (two launches, in order)."""
    common = [SCRIPT, "--", *COMMON, "--ckpt-format", "dcp", "--ckpt-dir", d / "ck"]
    launch.torchrun(str(SAMPLE_PROBE), nproc=2, max_restarts=1, stream=False, timeout=400,
                    env={"SAMPLE_LOG": str(d / "drill")},
                    args=[*common, "--max-steps", 18, "--save-every", 9, "--crash-at-step", 9,
                          "--metrics-out", d / "drill.jsonl"])
    return launch.torchrun(str(SAMPLE_PROBE), nproc=3, stream=False, timeout=400,
                           env={"SAMPLE_LOG": str(d / "three")}, args=[*common, "--metrics-out", d / "three.jsonl"])


def straight(d):
    return launch.torchrun(str(SAMPLE_PROBE), nproc=2, stream=False, timeout=400,
                           env={"SAMPLE_LOG": str(d / "straight")},
                           args=[SCRIPT, "--", *COMMON, "--max-steps", 18, "--metrics-out", d / "straight.jsonl"])


def killed_rename(d):
    """One process: save at step 3, die renaming the step-6 save, then --resume auto to step 6."""
    ck, flags = d / "one" / "ck", [*COMMON, "--ckpt-format", "dcp", "--save-every", 3]
    (d / "dying.py").write_text(DYING_RENAME)
    first = run1(*flags, "--ckpt-dir", ck, "--max-steps", 3, cwd=d)
    listing = lambda: sorted(os.listdir(ck))
    died = run1(*flags, "--ckpt-dir", ck, "--max-steps", 6, cwd=d, program=str(d / "dying.py"))
    after_kill = listing()
    resumed = run1(*flags, "--ckpt-dir", ck, "--max-steps", 6, "--metrics-out", d / "one.jsonl", cwd=d)
    return {"first": first, "died": died, "after_kill": after_kill, "resumed": resumed, "end": listing()}


def small_files():
    """In the child: files over 32 KiB fail to write (EFBIG), as on a full disk. The probe file and
    meta.pt (12 KiB) fit; the 63 KiB file of weights and momentum does not."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (32768, 32768))


def mixups(d):
    """Each format handed the other's checkpoint, and a save that cannot write: (exit code, stderr)."""
    (d / "old.pt").write_bytes(b"a pt checkpoint stands here")
    (d / "folder.dcp").mkdir()
    return {"dcp_given_pt": run1(*COMMON, "--ckpt-format", "dcp", "--resume", d / "old.pt", cwd=d),
            "pt_given_dcp": run1(*COMMON, "--resume", d / "folder.dcp", cwd=d),
            "full": run1(*COMMON, "--ckpt-format", "dcp", "--max-steps", 2, "--save-every", 1,
                         "--ckpt-dir", d / "full", cwd=d, preexec_fn=small_files)}


def damaged(d):
    """One process saves at step 3; its folder, copied, then damaged three ways and resumed."""
    flags = [*COMMON, "--ckpt-format", "dcp", "--max-steps", 6]
    run1(*flags[:-2], "--max-steps", 3, "--save-every", 3, "--ckpt-dir", d / "dmg" / "good", cwd=d)
    out = {}
    for case in ("part", "metadata", "optimizer"):
        folder = d / "dmg" / case / "last.dcp"
        shutil.copytree(d / "dmg" / "good" / "last.dcp", folder)
        if case == "part":  # 64 bytes overwritten in the middle of the tensors' file
            (part,) = folder.glob("*.distcp")
            data = bytearray(part.read_bytes())
            data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
            part.write_bytes(bytes(data))
        elif case == "metadata":  # cut short
            (folder / ".metadata").write_bytes((folder / ".metadata").read_bytes()[:100])
        extra = ["--optimizer", "adamw"] if case == "optimizer" else []
        out[case] = run1(*flags, *extra, "--ckpt-dir", folder.parent, cwd=d)
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dcp")
    (d / "one").mkdir()
    with ThreadPoolExecutor(5) as pool:
        futures = {f.__name__: pool.submit(f, d) for f in (drill_then_three, straight, killed_rename, mixups,
                                                            damaged)}
        return d, {name: f.result() for name, f in futures.items()}


def samples(d, name, nproc):
    return [json.loads(line)["index"] for r in range(nproc)
            for line in (d / f"{name}.rank{r}").read_text().splitlines()]


def test_crash_and_resume_is_bitwise_equal_to_the_straight_run(jobs):
    d, _ = jobs
    recs = records(d / "drill.jsonl")
    assert [(r["attempt"], r["step"], r["path"]) for r in recs if r["kind"] == "resume"] == \
           [(1, 9, str(d / "ck" / "last.dcp"))]
    finals = [r for r in recs if r["kind"] == "final"]
    assert [(r["attempt"], r["step"]) for r in finals] == [(1, 18)]
    assert finals[0]["params_sha256"] == one(d / "straight.jsonl", "final")["params_sha256"]
    # and the drill trained on exactly the straight run's samples, in the same order, none twice
    assert sorted(samples(d, "drill", 2)) == sorted(samples(d, "straight", 2))
    assert len(set(samples(d, "drill", 2))) == 18 * 20


def test_every_rank_wrote_its_part_into_a_folder_renamed_when_complete(jobs):
    d, _ = jobs
    folder = d / "ck" / "last.dcp"
    parts = sorted(p.name for p in folder.iterdir())
    # 3 ranks saved last: DCP spreads the replicated tensors over the ranks, one file per writer
    assert ".metadata" in parts and "meta.pt" in parts
    assert len([p for p in parts if p.endswith(".distcp")]) >= 2, parts
    assert sorted(os.listdir(d / "ck")) == ["last.dcp"]  # no .tmp or .old left behind


def test_resume_on_three_ranks_sees_every_sample_once(jobs):
    d, runs = jobs
    assert "world size / batch size / accumulation changed" in runs["drill_then_three"].log
    three = records(d / "three.jsonl")
    assert [(r["step"], r["epoch"]) for r in three if r["kind"] == "resume"] == [(18, 0)]
    assert one(d / "three.jsonl", "final")["step"] == 18 + 1140 // 30
    # the drill's first attempt (killed at 9) and second (9 to 18), then 3 ranks to the epoch's end
    every = samples(d, "drill", 2) + samples(d, "three", 3)
    assert len(samples(d, "three", 3)) == 1140
    assert sorted(every) == list(range(1500)), "a sample was repeated or lost across the resumes"


def test_a_save_killed_before_its_rename_leaves_the_previous_checkpoint_to_resume(jobs):
    _, runs = jobs
    r = runs["killed_rename"]
    assert r["first"][0] == 0, r["first"][1][-2000:]
    assert r["died"][0] == -signal.SIGKILL
    # the new folder never took the name last.dcp; the previous one waits as last.dcp.old
    assert r["after_kill"] == ["last.dcp.old", "last.dcp.tmp"]
    assert r["resumed"][0] == 0, r["resumed"][1][-2000:]
    d = jobs[0]
    resume = one(d / "one.jsonl", "resume")
    assert (resume["step"], Path(resume["path"]).name) == (3, "last.dcp.old")
    assert one(d / "one.jsonl", "final")["step"] == 6
    assert r["end"] == ["last.dcp"]  # the next save cleaned up both


@pytest.mark.parametrize("case, fix", [("dcp_given_pt", "add --ckpt-format pt"),
                                       ("pt_given_dcp", "add --ckpt-format dcp")])
def test_the_other_formats_checkpoint_is_refused_with_the_fix(jobs, case, fix):
    code, err = jobs[1]["mixups"][case]
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fix in lines[0], err[-2000:]
    assert "Traceback" not in err


def test_a_failed_write_is_one_error_and_leaves_no_folder(jobs):
    d, runs = jobs
    code, err = runs["mixups"]["full"]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert "file too large" in lines[0] and "while saving" in lines[0] and "at step 1" in lines[0]
    assert "the temporary folder was removed and nothing was written" in lines[0]
    assert os.listdir(d / "full") == []  # no last.dcp.tmp, no probe file


@pytest.mark.parametrize("case, words", [
    ("part", "is damaged: its tensors fit this run but a part of the folder cannot be read ("),
    ("metadata", "is damaged: its .metadata cannot be read ("),
    ("optimizer", "does not fit this run's model and optimizer (first: optimizer.state."),
])
def test_a_damaged_or_mismatched_folder_is_one_error_naming_what(jobs, case, words):
    code, err = jobs[1]["damaged"][case]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: checkpoint "), err[-2000:]
    assert words in lines[0] and lines[0].endswith("--resume none"), lines[0]
