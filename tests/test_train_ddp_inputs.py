"""scripts/train_ddp.py on the inputs people really give it: other datasets, other models, a full disk.

Every path runs here on the CPU, on small files the tests make: a tiny ImageFolder, CIFAR-10 in
its real on-disk format, resnet18 and torch.compile for a couple of steps.
"""
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from ddp_lab.engine import launch

SCRIPT = launch.script("train_ddp.py")
FAST = ["--epochs", "1", "--max-steps", "2", "--progress", "off"]


def run(*args, cwd, program=None, preexec_fn=None, env=None):
    cmd = [sys.executable, *([program] if program else []), SCRIPT, *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, preexec_fn=preexec_fn,
                          env={**os.environ, **(env or {})})


def ok(proc):
    assert proc.returncode == 0, (proc.stdout[-1500:], proc.stderr[-3000:])
    return proc


def one_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def final(metrics_path):
    recs = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    return next(r for r in recs if r["kind"] == "final"), recs


# ---------------------------------------------------------------- imagefolder
def make_imagefolder(root, train_classes=("cat", "dog"), val_classes=("cat", "dog"), per_class=4):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split, classes, n in (("train", train_classes, per_class), ("val", val_classes, 2)):
        for c in classes:
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = torch.randint(0, 256, (12, 12, 3), generator=g, dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(root / split / c / f"{i}.png")
    return root


def test_imagefolder_trains(tmp_path):
    data = make_imagefolder(tmp_path / "imgs")
    m = tmp_path / "m.jsonl"
    ok(run("--dataset", "imagefolder", "--data-dir", data, "--model", "mlp", "--hidden", "8",
           "--batch-size", "4", "--metrics-out", m, *FAST, cwd=tmp_path))
    fin, recs = final(m)
    assert fin["step"] == 2
    assert [r["count"] for r in recs if r["kind"] == "eval"] == [4]  # every val image, once


def test_imagefolder_with_a_class_missing_from_val_is_refused(tmp_path):
    data = make_imagefolder(tmp_path / "imgs", train_classes=("ant", "cat", "dog"), val_classes=("cat", "dog"))
    one_error(run("--dataset", "imagefolder", "--data-dir", data, *FAST, cwd=tmp_path),
              "same class folders", "only in train/: ['ant']", "only in val/: none")


def test_imagefolder_with_an_empty_train_folder_is_one_error(tmp_path):
    data = make_imagefolder(tmp_path / "imgs")
    shutil.rmtree(data / "train")
    (data / "train").mkdir()
    one_error(run("--dataset", "imagefolder", "--data-dir", data, *FAST, cwd=tmp_path),
              "imagefolder:", "DATA_DIR/train/CLASS")


# ---------------------------------------------------------------- cifar10
CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
TRUST_MD5 = textwrap.dedent("""
    import hashlib, os, runpy, sys
    from torchvision.datasets import CIFAR10
    # The files are real CIFAR-10 pickles, but small: torchvision's integrity check still runs,
    # against these files' own md5 sums instead of the published ones.
    folder = os.path.join(os.environ["CIFAR_ROOT"], CIFAR10.base_folder)
    md5 = lambda name: hashlib.md5(open(os.path.join(folder, name), "rb").read()).hexdigest()
    CIFAR10.train_list = [[name, md5(name)] for name, _ in CIFAR10.train_list]
    CIFAR10.test_list = [[name, md5(name)] for name, _ in CIFAR10.test_list]
    CIFAR10.meta = {**CIFAR10.meta, "md5": md5(CIFAR10.meta["filename"])}
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def make_cifar(root, per_file=8):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for name in CIFAR_FILES:  # the layout torchvision reads: uint8 rows of 3x32x32, labels 0-9
        batch = {"data": torch.randint(0, 256, (per_file, 3072), generator=g, dtype=torch.uint8).numpy(),
                 "labels": torch.randint(0, 10, (per_file,), generator=g).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch))
    meta = {"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                            "ship", "truck"]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    return root


def test_cifar10_trains_from_the_real_on_disk_format(tmp_path):
    data = make_cifar(tmp_path / "data")
    (tmp_path / "trust_md5.py").write_text(TRUST_MD5)
    m = tmp_path / "m.jsonl"
    ok(run("--dataset", "cifar10", "--data-dir", data, "--model", "cnn", "--batch-size", "8",
           "--metrics-out", m, *FAST, cwd=tmp_path, program=str(tmp_path / "trust_md5.py"),
           env={"CIFAR_ROOT": str(data)}))
    fin, recs = final(m)
    assert fin["step"] == 2
    assert [r["count"] for r in recs if r["kind"] == "eval"] == [8]  # test_batch, every sample once


def test_corrupt_cifar10_says_not_found_or_corrupted(tmp_path):
    data = make_cifar(tmp_path / "data")  # no md5 patch: torchvision's integrity check fails
    one_error(run("--dataset", "cifar10", "--data-dir", data, *FAST, cwd=tmp_path),
              "not found or corrupted", "--download")


NO_NETWORK = """
import runpy, sys, urllib.error
import torchvision.datasets as d
class NoNetwork(d.CIFAR10):  # what torchvision raises on a node without network or name resolution
    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        if download:
            raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))
        super().__init__(root, train, transform, target_transform)
d.CIFAR10 = NoNetwork
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_download_without_network_says_so_and_names_network_true(tmp_path):
    """--download on a node that cannot reach the network: one error line naming the cause and both
    ways out (copy the files, or network=True from a notebook), exit 2, no URLError traceback."""
    wrapper = tmp_path / "no_network.py"
    wrapper.write_text(NO_NETWORK)
    one_error(run("--dataset", "cifar10", "--download", "--data-dir", tmp_path / "data", *FAST,
                  cwd=tmp_path, program=wrapper),
              "could not fetch CIFAR-10", "name resolution", "cannot reach the network", "network=True",
              "--data-dir")


# ---------------------------------------------------------------- models and compile
def test_resnet18_trains_a_couple_of_steps(tmp_path):
    m = tmp_path / "m.jsonl"
    ok(run("--dataset", "synthetic", "--synthetic-shape", "3,32,32", "--synthetic-size", "64",
           "--model", "resnet18", "--batch-size", "8", "--metrics-out", m, *FAST, cwd=tmp_path))
    assert final(m)[0]["step"] == 2


def test_compile_compiles_and_matches_eager(tmp_path):
    """--compile really compiles (Inductor writes the code it generates into its cache folder; for the
    default mlp, a bare nn.Sequential, torch.compile(DDP(model)) wrote nothing, and so did model.compile()
    before torch 2.14), trains like eager, and its checkpoint keeps the eager run's parameter names."""
    runs, generated = {}, {}
    for name, flags in (("eager", []), ("compiled", ["--compile"])):
        m, cache = tmp_path / f"{name}.jsonl", tmp_path / f"inductor_{name}"
        ok(run("--max-steps", "3", "--epochs", "1", "--log-every", "1", "--progress", "off",
               "--metrics-out", m, "--ckpt-dir", tmp_path / f"ckpt_{name}", *flags, cwd=tmp_path,
               env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}))
        runs[name] = final(m)[1]
        generated[name] = [p for p in cache.rglob("*.py")] if cache.exists() else []
    losses = {k: [r["loss"] for r in v if r["kind"] == "train"] for k, v in runs.items()}
    assert len(losses["compiled"]) == 3
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)
    assert generated["compiled"] and not generated["eager"]
    keys = {name: list(torch.load(tmp_path / f"ckpt_{name}" / "last.pt", weights_only=True)["model"])
            for name in runs}
    assert keys["compiled"] == keys["eager"] and not any("_orig_mod" in k for k in keys["compiled"]), keys


def test_non_image_samples_train_an_mlp_and_name_the_fix_for_a_cnn(tmp_path):
    """The adaptation docs/train_ddp.md describes: a dataset of flat feature vectors."""
    sys.path.insert(0, str(launch.SCRIPTS))
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location("train_ddp_adapt", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(launch.SCRIPTS))
    model = mod.build_model(mod.parse_args(["--model", "mlp"]), (20,), 3)
    assert model(torch.randn(5, 20)).shape == (5, 3)
    with pytest.raises(mod.UsageError, match=r"shaped \(20,\): use --model mlp"):
        mod.build_model(mod.parse_args(["--model", "cnn"]), (20,), 3)


# ---------------------------------------------------------------- checkpoints that do not fit
@pytest.fixture(scope="module")
def mlp64_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlp64")
    ok(run("--max-steps", "2", "--hidden", "64", "--ckpt-dir", d / "ck", "--progress", "off", cwd=d))
    return d / "ck" / "last.pt"


def test_checkpoint_with_another_width_names_hidden(tmp_path, mlp64_ckpt):
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copy(mlp64_ckpt, ck / "last.pt")
    err = one_error(run("--hidden", "128", "--ckpt-dir", ck, *FAST, cwd=tmp_path),
                    "written with --hidden 64, this run has --hidden 128")
    assert "--model" not in err.split("this run has")[1].split(";")[0]  # only what differs is named
    assert (ck / "last.pt").read_bytes() == mlp64_ckpt.read_bytes()


def test_checkpoint_from_another_dataset_of_the_same_shape_is_refused(tmp_path, mlp64_ckpt):
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copy(mlp64_ckpt, ck / "last.pt")
    one_error(run("--dataset", "synthetic", "--synthetic-shape", "1,8,8", "--synthetic-size", "1500",
                  "--ckpt-dir", ck, *FAST, cwd=tmp_path),
              "written with --dataset digits", "this run has --dataset synthetic")


# ---------------------------------------------------------------- a full disk
def _file_size_limit(limit_bytes):
    def apply():
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


def test_full_disk_while_saving_keeps_last_pt_and_says_so(tmp_path, mlp64_ckpt):
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copy(mlp64_ckpt, ck / "last.pt")
    before = (ck / "last.pt").read_bytes()
    limit = len(before) // 2  # the probe fits, a checkpoint does not
    err = one_error(run("--max-steps", "4", "--save-every", "1", "--ckpt-dir", ck, "--progress", "off",
                        cwd=tmp_path, preexec_fn=_file_size_limit(limit)),
                    "while saving", "at step 3", "last.pt is still the step-2 checkpoint")
    assert "file too large" in err or "no space left" in err
    assert (ck / "last.pt").read_bytes() == before
    assert sorted(p.name for p in ck.iterdir()) == ["last.pt"]  # no .tmp, no probe left behind


def test_full_disk_before_training_is_one_error_and_no_probe(tmp_path):
    ck = tmp_path / "ck"
    one_error(run("--ckpt-dir", ck, *FAST, cwd=tmp_path, preexec_fn=_file_size_limit(1)),
              "is not writable", "free space")
    assert list(ck.iterdir()) == []


# ---------------------------------------------------------------- learning rate
@pytest.mark.parametrize("rule,peak", [("none", 0.05), ("sqrt", 0.1), ("linear", 0.2)])
def test_lr_scaling_rule_and_the_rate_each_step_used(tmp_path, rule, peak):
    """4 accumulation steps make the batch 4x larger: linear x4, sqrt x2. With 2 warmup epochs
    (24 steps of 12 per epoch at batch 32 x 4) step s uses peak x s/24: the logged rate is the
    one the step used, so step 1 is the first warmup rate, not the second."""
    m = tmp_path / "m.jsonl"
    ok(run("--accum-steps", "4", "--lr-scaling", rule, "--lr", "0.05", "--warmup-epochs", "2",
           "--lr-schedule", "constant", "--max-steps", "3", "--log-every", "1", "--progress", "off",
           "--metrics-out", m, cwd=tmp_path))
    train = [r for r in final(m)[1] if r["kind"] == "train"]
    steps_per_epoch = math.ceil(math.ceil(1500 / 32) / 4)
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r["lr"] for r in train] == pytest.approx([peak * s / (2 * steps_per_epoch) for s in (1, 2, 3)])


def test_profile_steps_writes_one_chrome_trace_per_rank(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--max-steps", "4", "--profile-steps", "2:3",
                           "--profile-dir", str(tmp_path / "prof")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gpuGetDeviceCount failed" not in proc.stderr  # kineto's CPU-only noise is silenced
    trace = json.loads((tmp_path / "prof" / "rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    # two optimizer steps of a DDP model: its forward, autograd's backward, the optimizer
    assert any(n.startswith("DistributedDataParallel.forward") for n in names), sorted(names)[:40]
    assert any("Optimizer.step" in n for n in names)
    for bad in ("3:2", "0:1", "x"):
        proc = subprocess.run([sys.executable, str(SCRIPT), "--profile-steps", bad], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "--profile-steps" in proc.stderr, proc.stderr
