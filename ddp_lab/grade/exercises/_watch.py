"""What the graders of notebook 12 see of an answer's communication, and what they refuse.

`Watch` replaces torch.distributed's collectives while an answer runs and records each call as an
event, beside the events the grader adds itself (a gradient became ready, backward returned). With
`defer=True` an all-reduce issued with async_op=True does not run until its handle's wait(): then
code that reads the buffer before waiting reads it un-reduced, every time, instead of by chance,
and the grader sees exactly which handles were waited for, and when.
"""
from __future__ import annotations

import contextlib

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_reduce_coalesced")
TORCH_OWN = {  # what a submission may not hand the work to
    "DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
    "ZeroRedundancyOptimizer": "torch.distributed.optim.ZeroRedundancyOptimizer",
    "SyncBatchNorm": "torch.nn.SyncBatchNorm",
    "FullyShardedDataParallel": "FSDP",
    "FSDPModule": "FSDP2's fully_shard",
}


class _Deferred:
    """A handle whose all-reduce runs when it is waited for (the grader's stand-in for gloo's Work)."""

    def __init__(self, watch, index, run):
        self.watch, self.index, self._run, self.done = watch, index, run, False

    def wait(self, *args, **kwargs):
        if not self.done:
            self._run()
            self.done = True
        self.watch.events.append(("wait", self.index, self.watch.phase))
        return True

    def is_completed(self):
        return self.done

    def get_future(self):
        import torch
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


class _Recorded:
    """gloo's own handle, with each wait() recorded (the all-reduce runs as issued)."""

    def __init__(self, watch, index, work):
        self.watch, self.index, self.work = watch, index, work

    def wait(self, *args, **kwargs):
        self.watch.events.append(("wait", self.index, self.watch.phase))
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


class Watch:
    def __init__(self, defer: bool = False):
        self.defer, self.events, self.phase, self._saved = defer, [], "setup", {}

    def mark(self, *event):
        self.events.append(event)

    def calls(self, phase=None, name=None) -> list:
        return [e for e in self.events if e[0] == "call" and (phase is None or e[3] == phase)
                and (name is None or e[1] == name)]

    @contextlib.contextmanager
    def watching(self):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        for name in COLLECTIVES:
            real = getattr(dist, name, None)
            if real is None:
                continue
            self._saved[name] = real
            wrapper = self._wrap(name, real)
            setattr(dist, name, wrapper)
            if getattr(c10d, name, None) is real:
                setattr(c10d, name, wrapper)
        try:
            yield self
        finally:
            for name, real in self._saved.items():
                setattr(dist, name, real)
                if hasattr(c10d, name):
                    setattr(c10d, name, real)
            self._saved = {}

    def _wrap(self, name, real):
        def collective(tensor=None, *args, **kwargs):
            numel = tensor.numel() if hasattr(tensor, "numel") else -1
            async_op = bool(kwargs.get("async_op", False))
            index = len(self.calls())
            self.events.append(("call", name, numel, self.phase, async_op, index))
            if name == "all_reduce" and async_op and self.defer:
                rest = {k: v for k, v in kwargs.items() if k != "async_op"}
                return _Deferred(self, index, lambda: real(tensor, *args, **rest))
            work = real(tensor, *args, **kwargs)
            return _Recorded(self, index, work) if async_op and work is not None else work
        return collective


def torch_own_inside(obj, depth: int = 3) -> str | None:
    """The name of torch's own DDP, ZeroRedundancyOptimizer, SyncBatchNorm or FSDP held by the
    answer's object (as an attribute, submodule or in a list), or None."""
    seen = set()

    def walk(o, d):
        if id(o) in seen or d < 0:
            return None
        seen.add(id(o))
        for cls in type(o).__mro__:
            if cls.__name__ in TORCH_OWN and cls.__module__.startswith("torch"):
                return TORCH_OWN[cls.__name__]
        children = []
        if hasattr(o, "modules") and callable(o.modules):
            try:
                children += [m for m in o.modules() if m is not o]
            except Exception:
                pass
        if isinstance(o, (list, tuple)):
            children += list(o)
        elif isinstance(o, dict):
            children += list(o.values())
        elif hasattr(o, "__dict__") and not type(o).__module__.startswith("torch"):
            children += list(vars(o).values())
        for c in children:
            if type(c).__module__.startswith(("builtins", "numpy")) and not isinstance(c, (list, tuple, dict)):
                continue
            found = walk(c, d - 1)
            if found:
                return found
        return None
    return walk(obj, depth)


def refusal(per_rank: dict) -> list:
    """The one finding when any rank saw torch's own class inside the answer (on_rank's "refused"),
    else []."""
    name = next((o["refused"] for o in per_rank.values() if o.get("refused")), None)
    return [] if name is None else [f"refused: your answer hands the work to {name}. This exercise is to "
                                    f"build it yourself; torch's class is what the grader compares against"]
