"""Runs a program's main() with every DDP model counting its gradient all-reduces
(ddp_lab.lessons.accumulation.AllReduceCounter, the counter notebook 05 uses), and prints the count:

    torchrun ... comm_probe.py SCRIPT -- ARGS...      ->  "COMM {"rank": R, "calls": N}"
                                                          "VIEWS {"rank": R, "views": [bool, ...]}"

One call per gradient bucket per synchronising backward: no_sync() micro-steps add none. VIEWS says, for
each DDP model the program built, whether its gradients are views into the buckets (notebook 11 §1
shows what that option does to where each .grad lives).
"""
import importlib.util
import json
import os
import sys

import torch.nn.parallel
from torch.nn.parallel import DistributedDataParallel

from ddp_lab.lessons.accumulation import AllReduceCounter

script, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
counters, views = [], []


class CountingDDP(DistributedDataParallel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        counters.append(AllReduceCounter(self))
        views.append(self.gradient_as_bucket_view)


spec = importlib.util.spec_from_file_location("probed", script)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
if hasattr(mod, "DDP"):
    mod.DDP = CountingDDP
torch.nn.parallel.DistributedDataParallel = CountingDDP
sys.argv = [script, *argv]
mod.main(*([argv] if mod.main.__code__.co_argcount else []))
calls = sum(c.calls for c in counters)
print("VIEWS " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "views": views}), flush=True)
print("COMM " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "calls": calls}), flush=True)  # the last line
