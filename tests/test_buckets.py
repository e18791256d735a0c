"""Buckets: our assignment rule is DDP's (the launch that measures DDP's own buckets is asserted in
notebook 03)."""
from ddp_lab.lessons import buckets, models

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


def test_n_params_of_the_bucket_model():
    assert models.n_params(buckets.deep_mlp(width=8, depth=2, in_features=4, classes=3)) == 4 * 8 + 8 + 8 * 8 + 8 + 8 * 3 + 3
