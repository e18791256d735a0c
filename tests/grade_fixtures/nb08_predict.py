"""08.5: a right exposed-time prediction and the wrong ones, each with the hint it must get."""
import numpy as np


def _ring(size, n, alpha, beta):
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size * beta


def good(sizes, n, alpha, beta, t_backward):
    total, done, end = sum(sizes), 0.0, 0.0
    for size in sizes:
        done += size
        ready = t_backward * done / total
        end = max(ready, end) + _ring(size, n, alpha, beta)
    return max(0.0, end - t_backward)


def all_comm(sizes, n, alpha, beta, t_backward):
    return sum(_ring(s, n, alpha, beta) for s in sizes)


def from_the_start(sizes, n, alpha, beta, t_backward):
    return max(0.0, all_comm(sizes, n, alpha, beta, t_backward) - t_backward)


def last_bucket(sizes, n, alpha, beta, t_backward):
    return _ring(sizes[-1], n, alpha, beta)


def half_ring(sizes, n, alpha, beta, t_backward):
    return good(sizes, n, alpha / 2, beta / 2, t_backward)


def in_float32(sizes, n, alpha, beta, t_backward):
    f = np.float32
    return good([f(s) for s in sizes], n, f(alpha), f(beta), f(t_backward))


PRECISIONS = {"float32": in_float32, "float64": good}


MISTAKES = {
    "all communication": (all_comm, "what runs before backward ends is hidden"),
    "buckets start with backward": (from_the_start, "starts only when its last gradient appears"),
    "last bucket only": (last_bucket, "one all-reduce runs at a time"),
    "reduce-scatter only": (half_ring, "a reduce-scatter and an all-gather"),
}
