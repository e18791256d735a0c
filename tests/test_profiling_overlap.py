"""ddp_lab.lessons.profiling.overlap (how much of each bucket hid under backward) and
profiling.captured_stderr (torch's C++ warnings caught at the file descriptor), on hand-made input."""
import os
import sys

import pytest

from ddp_lab.lessons import profiling
from ddp_lab.lessons.profiling import overlap


def X(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "cat": "cpu_op"}


def step(t0, buckets):
    """data 0-1 ms, forward 1-3 ms, backward span 3-9 ms with compute 3-7 ms, optimizer 9-10 ms;
    the buckets' all-reduces (start, end in ms from t0) on gloo's thread."""
    p = profiling.PREFIX
    ev = [X(p + "step", t0, 10000), X(p + "data", t0, 1000), X(p + "forward", t0 + 1000, 2000),
          X(p + "backward", t0 + 3000, 6000),
          X("autograd::engine::evaluate_function: AddmmBackward0", t0 + 3000, 4000),
          X(p + "optimizer", t0 + 9000, 1000)]
    ev += [X("gloo:all_reduce", t0 + a * 1000, (b - a) * 1000, tid=2) for a, b in buckets]
    return ev


def steps(*per_step):
    events = [e for i, b in enumerate(per_step) for e in step(20000 * i, b)]
    return profiling.steps({"distributedInfo": {"rank": 0}, "traceEvents": events})


def test_first_bucket_hides_only_under_the_compute_left_and_the_last_is_exposed():
    # bucket 0 runs 5-8 ms: 2 ms of compute left (5-7), it hides 2 ms; bucket 1 runs 8-9 ms, after compute
    hid = overlap.comm_hidden_by_backward(steps([(5, 8), (8, 9)]))
    assert (hid.steps, hid.buckets) == (1, 2)
    assert hid.first_ms == pytest.approx(3.0)
    assert hid.first_room_ms == pytest.approx(2.0) and hid.first_hidden_ms == pytest.approx(2.0)
    assert hid.started_early == 1.0 and hid.last_exposed == pytest.approx(1.0)
    assert hid.hidden_share == pytest.approx(2.0 / 4.0)
    text = str(hid)
    assert "2 all-reduces per step" in text and "2.0 ms did hide" in text and "100% of it" in text


def test_a_late_first_bucket_has_no_room_and_steps_are_averaged():
    # step 0: bucket 0 at 7.5-8 ms (after compute): no room, nothing hidden; step 1: 4-6 ms, all hidden
    hid = overlap.comm_hidden_by_backward(steps([(7.5, 8), (8, 8.5)], [(4, 6), (8, 8.5)]))
    assert hid.steps == 2 and hid.started_early == 0.5
    assert hid.first_room_ms == pytest.approx((0 + 2) / 2) and hid.first_hidden_ms == pytest.approx(1.0)
    assert hid.first_ms == pytest.approx((0.5 + 2) / 2)


def test_one_bucket_is_told_as_one_and_no_all_reduce_is_an_error():
    hid = overlap.comm_hidden_by_backward(steps([(6, 8)]))
    assert hid.buckets == 1 and hid.last_exposed == pytest.approx(0.5)
    assert str(hid).startswith("1 all-reduce per step: the whole model is one bucket")
    with pytest.raises(ValueError, match="2 or more ranks"):
        overlap.comm_hidden_by_backward(steps([]))


def test_captured_stderr_catches_the_descriptor_and_restores_it(capfd):
    with profiling.captured_stderr() as lines:
        os.write(2, b"[W CPUAllocator.cpp:245] Memory block of unknown size\nsecond line\n")
    assert lines == ["[W CPUAllocator.cpp:245] Memory block of unknown size", "second line"]
    os.write(2, b"after\n")
    sys.stderr.flush()
    assert capfd.readouterr().err == "after\n"
