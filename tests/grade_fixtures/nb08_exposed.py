"""08.4: a right exposed-communication time and the wrong ones, each with the hint it must get."""
import numpy as np


def good(backward, buckets):
    bw_start, bw_end = backward
    exposed = 0.0
    for start, end in buckets:  # buckets run one after another: they do not overlap each other
        exposed += max(0.0, min(end, bw_start) - start) + max(0.0, end - max(start, bw_end))
    return exposed


def total(backward, buckets):
    return sum(end - start for start, end in buckets)


def minus_backward(backward, buckets):
    return max(0.0, total(backward, buckets) - (backward[1] - backward[0]))


def last_end(backward, buckets):
    return max(0.0, max(end for _, end in buckets) - backward[1])


def last_bucket(backward, buckets):
    start, end = buckets[-1]
    return max(0.0, end - max(start, backward[1]))


def in_float32(backward, buckets):  # times as float32, as a profiler's microseconds / 1000 might be
    return good(np.float32(backward), [np.float32(b) for b in buckets])


def total_float32(backward, buckets):
    return total(np.float32(backward), [np.float32(b) for b in buckets])


PRECISIONS = {"float32": in_float32, "float64": good}


MISTAKES = {
    "all communication": (total, "the part that runs while backward computes is hidden"),
    "durations only": (minus_backward, "compare when the all-reduces run"),
    "counts the gap": (last_end, "a gap after backward with no all-reduce running"),
    "last bucket only": (last_bucket, "every bucket counts"),
    "the whole all-reduce time, in float32": (total_float32, "that is the whole all-reduce time"),
}
