"""scripts/train_ddp.py as one process: accumulation, resume, and a kill in the middle of a save."""
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_lab.engine import launch

SCRIPT = launch.script("train_ddp.py")
COMM_PROBE = Path(__file__).parent / "programs" / "comm_probe.py"  # counts DDP's all-reduces


def start(*args, cwd, program=None):
    argv = [sys.executable, program or SCRIPT, *map(str, args)]
    return subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, ok=True):
    out, err = proc.communicate(timeout=300)
    if ok:
        assert proc.returncode == 0, err[-3000:]
    return proc.returncode, out, err


def metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def final(path):
    return next(r for r in metrics(path) if r["kind"] == "final")


def test_accumulation_equals_big_batch_and_syncs_once_per_step(tmp_path):
    # two runs side by side: 4 micro-batches of 8 vs one batch of 32, 20 optimizer steps each
    runs = {k: start(SCRIPT, "--", "--max-steps", 20, "--ckpt-dir", tmp_path / f"k{k}",
                     "--metrics-out", tmp_path / f"k{k}.jsonl", "--batch-size", 32 // k,
                     "--accum-steps", k, cwd=tmp_path, program=COMM_PROBE) for k in (1, 4)}
    calls = {k: json.loads(finish(p)[1].split("COMM ")[-1])["calls"] for k, p in runs.items()}
    a = torch.load(tmp_path / "k1" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "k4" / "last.pt", weights_only=True)["model"]
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=f"{k} differs")
    cfg = next(r for r in metrics(tmp_path / "k4.jsonl") if r["kind"] == "config")
    assert cfg["effective_batch"] == 32 and cfg["accum_steps"] == 4
    # 80 micro-steps, K = 4: no_sync leaves 80 / 4 = 20 gradient all-reduces (one bucket each)
    assert calls == {1: 20, 4: 80 // 4}


def test_two_epochs_equal_one_epoch_then_resume(tmp_path):
    # batch 64: 24 steps per epoch. --max-steps 24 stops exactly after epoch 0, and the save at
    # step 24 records "epoch 0, all 24 batches consumed": the resumed run skips the whole epoch.
    common = ["--epochs", 2, "--batch-size", 64, "--log-every", 8]
    straight = start(*common, "--metrics-out", tmp_path / "straight.jsonl", cwd=tmp_path)
    first = start(*common, "--max-steps", 24, "--save-every", 24, "--ckpt-dir", tmp_path / "ck",
                  "--metrics-out", tmp_path / "resumed.jsonl", cwd=tmp_path)
    finish(first)
    finish(start(*common, "--ckpt-dir", tmp_path / "ck", "--metrics-out", tmp_path / "resumed.jsonl",
                 cwd=tmp_path))
    finish(straight)
    recs = metrics(tmp_path / "resumed.jsonl")
    assert [(r["step"], r["epoch"]) for r in recs if r["kind"] == "resume"] == [(24, 0)]
    # epoch 0 is evaluated once per run (the resumed run re-evaluates the restored epoch 0)
    assert [(r["attempt"], r["epoch"], r["step"]) for r in recs if r["kind"] == "eval"] == \
           [(0, 0, 24), (0, 0, 24), (0, 1, 48)]
    finals = [r for r in recs if r["kind"] == "final"]
    assert [r["step"] for r in finals] == [24, 48]
    assert finals[-1]["params_sha256"] == final(tmp_path / "straight.jsonl")["params_sha256"]
    assert finals[0]["params_sha256"] != finals[-1]["params_sha256"]  # the second run did train
    # the resumed run continues the schedule: its step-32 record equals the straight run's
    lr = lambda rs: [r["lr"] for r in rs if r["kind"] == "train" and r["step"] == 32]
    assert lr(recs) == lr(metrics(tmp_path / "straight.jsonl")) and len(lr(recs)) == 1


DYING_SAVE = """
import io, os, signal, sys, runpy, torch
real_save = torch.save
def dying_save(obj, f, *args, **kwargs):  # write half the checkpoint, then die like a killed job
    if not str(getattr(f, "name", f)).endswith(".tmp"):  # torch also saves into buffers to pickle tensors
        return real_save(obj, f, *args, **kwargs)
    buf = io.BytesIO()
    real_save(obj, buf, *args, **kwargs)
    out = f if hasattr(f, "write") else open(f, "wb")  # the script passes an open file
    out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
    out.flush()
    os.fsync(out.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = dying_save
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def test_kill_while_saving_leaves_previous_checkpoint_loadable(tmp_path):
    ck = tmp_path / "ck"
    finish(start("--max-steps", 5, "--ckpt-dir", ck, cwd=tmp_path))
    before = (ck / "last.pt").read_bytes()

    (tmp_path / "dying.py").write_text(DYING_SAVE)
    proc = start(SCRIPT, "--max-steps", 10, "--save-every", 2, "--ckpt-dir", ck, cwd=tmp_path,
                 program=str(tmp_path / "dying.py"))
    code, out, _ = finish(proc, ok=False)
    assert code == -signal.SIGKILL
    assert "resumed from" in out  # it loaded step 5, trained step 6, died saving it
    partial = ck / "last.pt.tmp"
    assert partial.exists() and 0 < partial.stat().st_size < len(before) * 0.75
    with pytest.raises(Exception):  # the half-written file does not load: the kill hit mid-write
        torch.load(partial, weights_only=True)
    assert (ck / "last.pt").read_bytes() == before  # the previous checkpoint, untouched
    assert torch.load(ck / "last.pt", weights_only=True)["step"] == 5

    # and the next run resumes from it and finishes
    finish(start("--max-steps", 10, "--ckpt-dir", ck, "--metrics-out", tmp_path / "m.jsonl", cwd=tmp_path))
    recs = metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in recs if r["kind"] == "resume"] == [5]
    assert final(tmp_path / "m.jsonl")["step"] == 10
    assert not partial.exists()  # the next save replaced the torn temp file


SAMPLE_PROBE = Path(__file__).parent / "programs" / "sample_probe.py"  # logs every sample index used


def test_resume_on_another_world_size_sees_every_sample_once(tmp_path):
    # One epoch of the 1500 digits, batch 10 per rank, over three launches:
    #   2 ranks, killed after step 3 (saved at 3):   60 samples, position 60
    #   3 ranks, killed after step 7 (saved at 7):  120 samples, position 180
    #   2 ranks to the end of the epoch:           1320 samples (66 steps)
    # Each launch logs the indices its sampler handed out; together they must be the epoch's
    # shuffled order, every sample exactly once (the sizes leave no padding to repeat).
    common = [SCRIPT, "--", "--epochs", 1, "--batch-size", 10, "--ckpt-dir", tmp_path / "ck",
              "--metrics-out", tmp_path / "m.jsonl", "--log-every", 1]
    plan = [(2, ["--crash-at-step", 3, "--save-every", 3]), (3, ["--crash-at-step", 7, "--save-every", 7]),
            (2, [])]
    for k, (nproc, extra) in enumerate(plan):
        env = {"SAMPLE_LOG": str(tmp_path / f"samples{k}")}
        try:
            launch.torchrun(str(SAMPLE_PROBE), nproc=nproc, stream=False, env=env, args=[*common, *extra])
        except launch.LaunchError as e:  # the crash drill: every rank SIGKILLs itself after the save
            assert extra and "crash-at-step" in e.run.log, e
    seen = {}
    for k, (nproc, _) in enumerate(plan):
        for r in range(nproc):
            for line in (tmp_path / f"samples{k}.rank{r}").read_text().splitlines():
                seen.setdefault(k, []).append(json.loads(line)["index"])
    assert [len(seen[k]) for k in range(3)] == [60, 120, 1320]
    every = seen[0] + seen[1] + seen[2]
    assert sorted(every) == list(range(1500)), "a sample was repeated or lost across the resumes"
    resumes = [r for r in metrics(tmp_path / "m.jsonl") if r["kind"] == "resume"]
    assert [(r["step"], r["epoch"]) for r in resumes] == [(3, 0), (7, 0)]
    assert final(tmp_path / "m.jsonl")["step"] == 7 + 66


def test_resume_on_another_world_size_moves_the_schedule_to_the_data(tmp_path):
    # 2 ranks x 32, linear LR scaling (0.05 x 2), stopped at step 6 = sample 384 of epoch 0; then one
    # process (0.05 x 1, 47 steps an epoch, 94 in all) goes on: at this layout's rate, from step
    # 384 // 32 = 12 of its cosine, not from step 6 of 94 at the 2-rank rate.
    common = ["--epochs", 2, "--batch-size", 32, "--lr", 0.05, "--lr-scaling", "linear",
              "--ckpt-dir", tmp_path / "ck", "--metrics-out", tmp_path / "m.jsonl", "--log-every", 1]
    launch.torchrun(SCRIPT, nproc=2, stream=False, args=[*common, "--max-steps", 6])
    finish(start(*common, "--max-steps", 8, cwd=tmp_path))
    configs = [r for r in metrics(tmp_path / "m.jsonl") if r["kind"] == "config"]
    assert [(c["world_size"], c["lr_effective"], c["total_steps"]) for c in configs] == [(2, 0.1, 48), (1, 0.05, 94)]
    after = [r for r in metrics(tmp_path / "m.jsonl") if r["kind"] == "train" and r["step"] > 6]
    cosine = lambda i, total: 0.05 * 0.5 * (1 + math.cos(math.pi * i / total))
    assert [r["step"] for r in after] == [7, 8]
    assert all(math.isclose(r["lr"], cosine(12 + k, 94), rel_tol=1e-9) for k, r in enumerate(after)), after
