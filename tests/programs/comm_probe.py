"""Runs a program's main() with every DDP model counting its gradient all-reduces
(ddp_lab.lessons.accumulation.AllReduceCounter, the counter notebook 05 uses), and prints the count:

    torchrun ... comm_probe.py SCRIPT -- ARGS...      ->  "COMM {"rank": R, "calls": N}"

One call per gradient bucket per synchronising backward: no_sync() micro-steps add none.
"""
import importlib.util
import json
import os
import sys

import torch.nn.parallel
from torch.nn.parallel import DistributedDataParallel

from ddp_lab.lessons.accumulation import AllReduceCounter

script, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
counters = []


class CountingDDP(DistributedDataParallel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        counters.append(AllReduceCounter(self))


spec = importlib.util.spec_from_file_location("probed", script)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
if hasattr(mod, "DDP"):
    mod.DDP = CountingDDP
torch.nn.parallel.DistributedDataParallel = CountingDDP
sys.argv = [script, *argv]
mod.main(*([argv] if mod.main.__code__.co_argcount else []))
calls = sum(c.calls for c in counters)
print("COMM " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "calls": calls}), flush=True)
