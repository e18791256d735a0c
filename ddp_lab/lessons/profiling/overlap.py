"""Did DDP hide its all-reduces under backward? One answer, in plain words, from traced steps (notebook 08).

    from ddp_lab.lessons.profiling import overlap
    hid = overlap.comm_hidden_by_backward(steps)   # steps: profiling.Step of one or more ranks
    print(hid)                                     # the answer as a sentence
    hid.first_hidden_ms, hid.first_room_ms, hid.last_exposed

DDP all-reduces gradients in buckets while backward is still running. The first bucket (the last
layers' gradients, which backward produces first) can hide only under the backward compute still to
run when its all-reduce starts: that is its *room*. The last bucket (the first layers' gradients)
fills when backward is done, so nothing is left to hide it: it is *exposed*, the step waits for it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddp_lab.lessons import profiling


@dataclass
class BucketOverlap:
    """Means per traced step (of every rank given); times in milliseconds."""
    steps: int              # rank-steps read (those with at least one all-reduce)
    buckets: int            # all-reduces per step, as most steps ran them
    first_ms: float         # the first bucket's all-reduce
    first_room_ms: float    # of it, what could hide: backward compute still to run when it started
    first_hidden_ms: float  # of it, what ran while backward computed
    started_early: float    # share of steps whose first all-reduce began before backward's compute ended
    last_exposed: float     # share of the last bucket's all-reduce that ran with no backward compute
    hidden_share: float     # share of all all-reduce time that ran under any compute of the step

    def __str__(self) -> str:
        last = f"{self.last_exposed:.0%} of it ran with backward already done (exposed: the step waited for it)"
        if self.buckets == 1:
            return (f"1 all-reduce per step: the whole model is one bucket, full only when backward ends; "
                    f"{last}. {self.hidden_share:.0%} of all all-reduce time was hidden under compute.")
        return (f"{self.buckets} all-reduces per step, one per bucket. The first began while backward was still "
                f"computing in {self.started_early:.0%} of steps: it took {self.first_ms:.1f} ms, backward had "
                f"{self.first_room_ms:.1f} ms of compute left to hide it under, and {self.first_hidden_ms:.1f} ms "
                f"did hide. The last bucket: {last}. {self.hidden_share:.0%} of all all-reduce time was hidden "
                f"under compute.")


def _compute(step) -> list:
    return step.kernels.get("backward", []) if step.on_gpu else step.backward_ops


def comm_hidden_by_backward(steps) -> BucketOverlap:
    """How much of DDP's first and last bucket hid under backward's compute, over `steps`."""
    steps = [s for s in steps if s.comm]
    if not steps:
        raise ValueError("no all-reduce in these steps: read the traces of a run on 2 or more ranks")
    dur = lambda pair: pair[1] - pair[0]  # noqa: E731
    room = hidden = first = last = last_out = early = 0.0
    for s in steps:
        compute = _compute(s)
        bucket, end = s.comm[0], s.phases.get("backward", (s.start, s.end))[1]
        left = profiling.length(profiling.intersect(compute, [(bucket[0], max(end, bucket[0]))]))
        first += dur(bucket)
        room += min(dur(bucket), left)
        hidden += profiling.length(profiling.intersect([bucket], compute))
        early += bool(compute) and bucket[0] < compute[-1][1]
        last += dur(s.comm[-1])
        last_out += profiling.length(profiling.subtract([s.comm[-1]], compute))
    counts = [len(s.comm) for s in steps]
    k = len(steps)
    return BucketOverlap(steps=k, buckets=max(set(counts), key=counts.count), first_ms=first / k / 1e3,
                         first_room_ms=room / k / 1e3, first_hidden_ms=hidden / k / 1e3, started_early=early / k,
                         last_exposed=last_out / last if last else 0.0,
                         hidden_share=profiling.overlap_fraction(steps))
