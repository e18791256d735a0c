"""scripts/train_ddp.py under torchrun (gloo, 2 ranks): equivalence, metrics, evaluation, crash + restart.

One reference launch (2 ranks x batch 64, 20 steps across an epoch boundary) is shared by the tests.
"""
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ddp_lab.lessons import data, models
from ddp_lab.engine import launch

SCRIPT = Path(launch.script("train_ddp.py"))
# 1500 training digits / 2 ranks / 64 per batch = 12 steps per epoch: 20 steps cross into epoch 1.
COMMON = ["--batch-size", "64", "--max-steps", "20", "--log-every", "5"]
# runs a program with every DDP model counting its all-reduces (prints "COMM {rank, calls}")
COMM_PROBE = Path(__file__).parent / "programs" / "comm_probe.py"


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def load_module():
    spec = importlib.util.spec_from_file_location("train_ddp_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # safe: the script only runs main() under __main__
    return mod


def single_process(*args, cwd):
    proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref2")
    run = launch.torchrun(str(COMM_PROBE), nproc=2, stream=False, args=[
        SCRIPT, "--", *COMMON, "--ckpt-dir", d / "ckpt", "--metrics-out", d / "m.jsonl"])
    return d, run, read_metrics(d / "m.jsonl")


def comm_calls(run) -> dict:
    """{rank: gradient all-reduces} from comm_probe.py's lines."""
    found = {}
    for rank, lines in run.rank_lines.items():
        for line in lines:
            if line.startswith("COMM "):
                found[rank] = json.loads(line[5:])["calls"]
    return found


def final_state(ckpt_dir):
    return torch.load(Path(ckpt_dir) / "last.pt", weights_only=True)["model"]


def test_gradients_are_views_into_ddps_buckets(ref):
    """gradient_as_bucket_view=True: read in the comm hook of each bucket of every step, each .grad
    shares the bucket's storage (with the option off, each has its own: comm_probe.py counts 0)."""
    _, run, _ = ref
    views = {}
    for rank, lines in run.rank_lines.items():
        for line in lines:
            if line.startswith("VIEWS "):
                views[rank] = json.loads(line[6:])
    # one bucket (the mlp is 19 KB) per step, 20 steps; the results equal the runs without the
    # option: test_two_ranks_equal_one_process_with_double_batch and the crash test's bitwise match
    assert views == {r: {"rank": r, "buckets": 20, "in_bucket": 20} for r in (0, 1)}, views


def test_tf32_is_on_for_fp32_from_ampere_and_off_otherwise(monkeypatch):
    """set_tf32 with the GPU's compute capability faked: V100 7.0 and T4 7.5 off, A100 8.0 and H100 9.0
    on, for fp32 only (bf16/fp16 autocast: off); --tf32 off and the CPU: off. torch's flags follow,
    setting them warns of nothing (no deprecated API), and every getter still answers afterwards: the
    fp32_precision setters of torch 2.9+ would leave get_float32_matmul_precision() raising."""
    mod = load_module()
    cuda = torch.device("cuda", 0)
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for capability, flags, device, expected in [((8, 0), [], cuda, True), ((9, 0), [], cuda, True),
                                                        ((7, 0), [], cuda, False), ((7, 5), [], cuda, False),
                                                        ((9, 0), ["--tf32", "off"], cuda, False),
                                                        ((9, 0), ["--precision", "bf16"], cuda, False),
                                                        ((9, 0), ["--precision", "fp16"], cuda, False),
                                                        ((9, 0), [], torch.device("cpu"), False)]:
                monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
                label = mod.set_tf32(mod.parse_args(flags), device)
                got = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.fp32_precision,
                       torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
                want = ("high", "tf32", True, True) if expected else ("highest", "ieee", False, False)
                assert (label == " (TF32)") is expected and got == want, (capability, flags, device, label, got)
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_loader_workers_persist_across_epochs(tmp_path):
    """--num-workers: the training and the validation loader each start their worker once, not per epoch."""
    probe = Path(__file__).parent / "programs" / "loader_probe.py"
    proc = subprocess.run([sys.executable, str(probe), str(SCRIPT), "--", "--dataset", "synthetic",
                           "--synthetic-size", "256", "--synthetic-shape", "1,8,8", "--batch-size", "64",
                           "--num-workers", "1", "--epochs", "2", "--progress", "off"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("LOADERS ")]
    train, val = json.loads(line[8:])  # a loader that is not persistent would have started 2
    assert train == val == {"workers": 1, "persistent": True, "epochs": 2, "started": 1}, (train, val)


def test_gpu_loader_workers_start_from_a_fork_server_and_the_script_runs_that_way(tmp_path):
    """On a GPU the workers start from a fork server (not forked from a process holding CUDA and NCCL);
    on the CPU they fork. The fork-server path must work for the script's own datasets, run as a
    script: a copy whose rule says forkserver on the CPU too trains two epochs with a worker."""
    mod = load_module()
    assert mod.workers_start(torch.device("cuda", 0), 2) == "forkserver"
    assert mod.workers_start(torch.device("cpu"), 2) is None and mod.workers_start(torch.device("cuda", 0), 0) is None
    text = SCRIPT.read_text()
    rule = 'return "forkserver" if num_workers > 0 and device.type == "cuda" else None'
    assert rule in text
    copy = tmp_path / "train_forkserver.py"
    copy.write_text(text.replace(rule, 'return "forkserver" if num_workers > 0 else None'))
    proc = subprocess.run([sys.executable, str(copy), "--dataset", "synthetic", "--synthetic-size", "256",
                           "--synthetic-shape", "1,8,8", "--batch-size", "64", "--num-workers", "1", "--epochs", "2",
                           "--progress", "off", "--metrics-out", str(tmp_path / "m.jsonl")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert kinds.count("eval") == 2 and "final" in kinds, kinds


def test_two_ranks_equal_one_process_with_double_batch(ref, tmp_path):
    d, _, _ = ref
    single_process("--batch-size", "128", "--max-steps", "20", "--ckpt-dir", tmp_path / "one", cwd=tmp_path)
    two, one = final_state(d / "ckpt"), final_state(tmp_path / "one")
    assert two.keys() == one.keys()
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5, msg=f"{k} differs")
    # and training really moved the weights (an untrained model would also "agree")
    torch.manual_seed(0)
    fresh = models.mlp().state_dict()
    assert any((fresh[k] - one[k]).abs().max() > 1e-2 for k in one)


def test_metrics_records(ref):
    _, run, recs = ref
    assert {r["attempt"] for r in recs} == {0}
    config = [r for r in recs if r["kind"] == "config"]
    assert len(config) == 1 and config[0]["world_size"] == 2 and config[0]["effective_batch"] == 128
    assert config[0]["steps_per_epoch"] == 12 and config[0]["batch_size"] == 64
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert [r["epoch"] for r in train] == [0, 0, 1, 1]
    assert all(0 < r["loss"] < 3 and r["lr"] > 0 and r["samples_per_s"] > 0 for r in train)
    assert train[-1]["loss"] < train[0]["loss"]
    # eval after epoch 0 (step 12) and where --max-steps stopped (step 20)
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [(r["epoch"], r["step"]) for r in evals] == [(0, 12), (1, 20)]
    final = [r for r in recs if r["kind"] == "final"]
    assert len(final) == 1 and final[0]["step"] == 20 and len(final[0]["params_sha256"]) == 64
    # one gradient bucket (the mlp is 19 KB), one all-reduce per step
    assert comm_calls(run) == {0: 20, 1: 20}
    assert [r["step"] for r in recs if r["kind"] == "ckpt"] == [20]
    # rank 0 prints the (global) numbers; rank 1 prints none
    assert any("effective batch=64 x 2 ranks x 1 accum = 128" in line for line in run.rank_lines[0])
    assert not any(line.startswith(("step ", "eval ")) for line in run.rank_lines.get(1, []))


def test_distributed_eval_counts_every_sample_once(ref):
    _, _, recs = ref
    n_val = len(data.digits("val"))
    assert n_val % 2 == 1  # 297: two ranks do not divide it
    assert [r["count"] for r in recs if r["kind"] == "eval"] == [n_val, n_val]
    shard = load_module().evaluation_loader
    for n in (297, 10, 7, 3, 1):
        for world in range(1, 9):
            got = sorted(i for r in range(world) for i in shard(list(range(n)), r, world, 0, torch.device("cpu")).dataset.indices)
            assert got == list(range(n)), (n, world)


def test_is_sync_step_and_group_size_cover_the_short_tail():
    mod = load_module()
    # 10 batches, groups of 4: [0-3] [4-7] [8-9]: the tail group has 2 micro-batches and still steps
    syncs = [i for i in range(10) if mod.is_sync_step(i, 4, 10)]
    assert syncs == [3, 7, 9]
    assert [mod.group_size(i, 4, 10) for i in range(10)] == [4] * 8 + [2] * 2
    for accum in range(1, 7):
        for n in range(1, 20):
            ends = [i for i in range(n) if mod.is_sync_step(i, accum, n)]
            # one step per group, the last batch always ends one, each group's sizes sum to its batches
            assert len(ends) == -(-n // accum) and ends[-1] == n - 1, (accum, n)
            starts = [0] + [e + 1 for e in ends[:-1]]
            assert all(mod.group_size(i, accum, n) == e - s + 1
                       for s, e in zip(starts, ends) for i in range(s, e + 1)), (accum, n)


def test_crash_then_restart_is_bitwise_identical(ref, tmp_path):
    _, _, ref_recs = ref
    m = tmp_path / "m.jsonl"
    # Saves at 7 and 14; the ranks die after step 15; attempt 1 resumes at step 14
    # (epoch 1, batch 2: mid-epoch) and must replay step 15 exactly. Every rank kills itself.
    run = launch.torchrun("train_ddp.py", nproc=2, max_restarts=1, stream=False, timeout=400, args=[
        *COMMON, "--ckpt-dir", tmp_path / "ckpt", "--save-every", "7", "--crash-at-step", "15",
        "--metrics-out", m])
    assert run.returncode == 0
    assert "crash-at-step 15: killing rank 0 (attempt 0)" in run.log
    assert "crash-at-step 15: killing rank 1 (attempt 0)" in run.log
    recs = read_metrics(m)
    a0 = [r for r in recs if r["attempt"] == 0]
    a1 = [r for r in recs if r["attempt"] == 1]
    assert [r["step"] for r in a0 if r["kind"] == "ckpt"] == [7, 14]
    assert not any(r["kind"] == "final" for r in a0)
    assert [(r["step"], r["epoch"]) for r in a1 if r["kind"] == "resume"] == [(14, 1)]
    assert [r["kind"] for r in a1][:2] == ["config", "resume"]
    final = [r for r in a1 if r["kind"] == "final"]
    ref_final = [r for r in ref_recs if r["kind"] == "final"][0]
    assert final[0]["step"] == 20
    assert final[0]["params_sha256"] == ref_final["params_sha256"]
    # the first record after the resume averages step 15 alone, the uninterrupted run's steps 11-15; it says so
    assert [r["steps"] for r in a1 if r["kind"] == "train" and r["step"] == 15] == [1]
    assert [r["steps"] for r in ref_recs if r["kind"] == "train" and r["step"] == 15] == [5]
    assert "(loss of the 1 step since the resume at step 14; an uninterrupted run's record averages 5)" in run.log
    # both runs log steps 16-20 as one window: the same global loss, bit for bit
    assert [r["loss"] for r in a1 if r["kind"] == "train" and r["step"] == 20] == \
           [r["loss"] for r in ref_recs if r["kind"] == "train" and r["step"] == 20]


def test_models_and_data_match_the_workbook():
    mod = load_module()
    X, y = data.digits_tensors("train")
    train, val, classes = mod.load_digits_split()
    shape = tuple(train[0][0].shape)  # as train() reads it
    assert torch.equal(train.tensors[0], X) and torch.equal(train.tensors[1], y)
    assert torch.equal(val.tensors[0], data.digits_tensors("val")[0]) and (shape, classes) == ((1, 8, 8), 10)
    for flags, ref_model in ((["--model", "mlp"], lambda: models.mlp()),
                             (["--model", "cnn"], lambda: models.cnn()),
                             (["--model", "cnn", "--batch-norm"], lambda: models.cnn(batch_norm=True)),
                             (["--model", "wide_mlp"], lambda: models.wide_mlp())):
        torch.manual_seed(0)
        mine = mod.build_model(mod.parse_args(flags), shape, classes).state_dict()
        torch.manual_seed(0)
        theirs = ref_model().state_dict()
        assert mine.keys() == theirs.keys(), flags
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), flags


def test_resumable_sampler_is_distributed_sampler_when_nothing_changes():
    from torch.utils.data import DistributedSampler
    mod = load_module()
    for n, world, epoch in ((1500, 2, 0), (1500, 3, 1), (10, 4, 2), (7, 3, 5), (1, 2, 0)):
        for rank in range(world):
            ref = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=3)
            mine = mod.ResumableSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=3)
            ref.set_epoch(epoch)
            mine.set_epoch(epoch)
            assert list(mine) == list(ref) and len(mine) == len(ref), (n, world, rank)
            # a resume at batch b of size B on the same world: the same shard, b * B in
            for b, size in ((1, 2), (2, 1)):
                mine.start = b * size * world
                assert list(mine) == list(ref)[b * size:] and len(mine) == len(list(mine)), (n, world, b)
                mine.start = 0


def test_the_scripts_copies_of_workbook_code_stay_equal(tmp_path, monkeypatch):
    """Deliberate copies (scripts/ must run without ddp_lab): the same behaviour as the original."""
    from ddp_lab.lessons import checkpointing, sampling
    mod = load_module()
    for n in (297, 10, 3):  # exact evaluation shards: ddp_lab.lessons.sampling.exact_shard
        for world in (1, 2, 3, 5):
            for rank in range(world):
                got = list(mod.evaluation_loader(list(range(n)), rank, world, 0, torch.device("cpu")).dataset.indices)
                assert got == sampling.exact_shard(n, rank, world)
    # atomic saves: temp file in the same folder, fsync it, rename over, fsync the folder
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("replace", Path(a).parent == Path(b).parent)),
                                                     real_replace(a, b))[1])
    sequences = []
    for save in (lambda p: checkpointing.atomic_save({"x": 1}, p), lambda p: mod.atomic_save(str(p), {"x": 1})):
        calls.clear()
        save(tmp_path / f"ck{len(sequences)}.pt")
        sequences.append(list(calls))
    assert sequences[0] == sequences[1] == ["fsync", ("replace", True), "fsync"]
