"""Runs a program's main() and reports how many DDP models are still alive when it destroys the
process group. Automatic garbage collection is off, so the answer does not depend on when the
collector happens to run: a model kept alive by a reference cycle stays alive unless the program
releases it itself.

    python release_probe.py SCRIPT [--no-collect] -- ARGS...

--no-collect makes gc.collect() a no-op: the control that shows the pin is real.

Also reported: whether each DDP model alive at destroy still held its reducer (the C++ object that
owns the gradient buckets and the process group's work), how many DDP models are still alive after
main() returned, with the group gone, and how many after one real gc.collect().
"""
import gc
import importlib.util
import json
import sys
import weakref

import torch.distributed as dist
import torch.nn.parallel
from torch.nn.parallel import DistributedDataParallel

script, rest = sys.argv[1], sys.argv[2:]
no_collect = "--no-collect" in rest[:rest.index("--")]
argv = rest[rest.index("--") + 1:]

alive = []
built = [0]
at_destroy = []
reducers_at_destroy = []
real_collect = gc.collect


class TrackedDDP(DistributedDataParallel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        built[0] += 1
        alive.append(weakref.ref(self))


real_destroy = dist.destroy_process_group


def destroy(*args, **kwargs):
    at_destroy.append(sum(r() is not None for r in alive))
    reducers_at_destroy.append(sum(getattr(r(), "reducer", None) is not None for r in alive))
    return real_destroy(*args, **kwargs)


dist.destroy_process_group = destroy
spec = importlib.util.spec_from_file_location("probed", script)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
if hasattr(mod, "DDP"):
    mod.DDP = TrackedDDP
torch.nn.parallel.DistributedDataParallel = TrackedDDP  # programs that import it at call time
if no_collect:
    gc.collect = lambda *args: 0
gc.disable()
sys.argv = [script, *argv]
mod.main(*([argv] if mod.main.__code__.co_argcount else []))
after_return = sum(r() is not None for r in alive)
group_after_return = dist.is_initialized()
real_collect()
print("RELEASE " + json.dumps({"built": built[0], "alive_at_destroy": at_destroy,
                               "reducers_at_destroy": reducers_at_destroy, "alive_after_return": after_return,
                               "group_after_return": group_after_return,
                               "alive_after_collect": sum(r() is not None for r in alive)}), flush=True)
