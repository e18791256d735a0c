"""Buckets: our assignment rule is DDP's, and the measurements come back whole."""
import pytest

from ddp_lab.lessons import buckets, models
from ddp_lab.engine import launch

MB = buckets.MB


def test_assign_walks_backwards_and_closes_buckets_at_their_cap():
    sizes = [MB // 2] * 10
    assert buckets.assign(sizes, cap_bytes=MB) == [[9, 8], [7, 6], [5, 4], [3, 2], [1, 0]]
    # A small first bucket, then bigger ones; a tensor is never split.
    assert buckets.assign(sizes, cap_bytes=2 * MB, first_cap_bytes=MB // 2) == [[9], [8, 7, 6, 5], [4, 3, 2, 1], [0]]
    assert buckets.assign([5 * MB, 1], cap_bytes=MB) == [[1, 0]]


def test_deep_mlp_default_buckets_are_1mb_then_25mb():
    model = buckets.deep_mlp()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    got = buckets.assign(sizes, 25 * MB, MB)
    bytes_ = [sum(sizes[i] for i in b) for b in got]
    assert MB <= bytes_[0] < 2 * MB
    assert 25 * MB <= bytes_[1] < 27 * MB
    assert sum(len(b) for b in got) == len(sizes)


@pytest.mark.timeout(300)
def test_experiment_measures_equal_results_ddp_buckets_compression_and_stragglers():
    run = launch.torchrun("-m ddp_lab.experiments.nb03_buckets", nproc=2, stream=False,
                          args=["--steps", "2", "--batch", "8", "--caps", "5", "--epochs", "1",
                                "--delays", "0,0.2"])
    for eq in run.select(kind="equal"):
        assert eq["hand_vs_naive"] < 1e-6 and eq["ddp_vs_naive"] < 1e-6
    sizes = run.select(kind="model", rank=0)[0]["tensor_bytes"]
    ours = [sum(sizes[i] for i in b) for b in buckets.assign(sizes, 25 * MB, MB)]
    # DDP's own buckets, after its first-iteration rebuild, are the ones `assign` predicts.
    seen = [b["bytes"] for b in run.select(kind="bucket", rank=0, cap=None, iteration=1)]
    assert seen == ours
    explicit = [b["bytes"] for b in run.select(kind="bucket", rank=0, cap=5.0, iteration=1)]
    assert explicit == [sum(sizes[i] for i in b) for b in buckets.assign(sizes, 5 * MB)]
    comp = {c["hook"]: c for c in run.select(kind="compress", rank=0)}
    assert comp["fp16 compress"]["bytes_per_step"] * 2 == comp["fp32 (default)"]["bytes_per_step"]
    assert comp["bf16 compress"]["bytes_per_step"] * 2 == comp["fp32 (default)"]["bytes_per_step"]
    # The fast rank waits for the slow one: its time inside the all-reduce is the longer.
    slow = [s for s in run.select(kind="straggler", delay=0.2)]
    wait = {r: sum(s["wait_s"] for s in slow if s["rank"] == r) for r in (0, 1)}
    assert wait[0] > wait[1]


def test_n_params_of_the_bucket_model():
    assert models.n_params(buckets.deep_mlp(width=8, depth=2, in_features=4, classes=3)) == 4 * 8 + 8 + 8 * 8 + 8 + 8 * 3 + 3
