"""Runs a program's main() with every DDP model counting its gradient all-reduces (a comm hook
that counts, then all-reduces as DDP would), and prints the count on each rank:

    torchrun ... comm_probe.py SCRIPT -- ARGS...      ->  "COMM {"rank": R, "calls": N}"

One call per gradient bucket per synchronising backward: no_sync() micro-steps add none.
"""
import importlib.util
import json
import os
import sys

import torch.nn.parallel
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

script, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
calls = [0]


def counting_allreduce(state, bucket):
    calls[0] += 1
    return default_hooks.allreduce_hook(state, bucket)


class CountingDDP(DistributedDataParallel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_comm_hook(None, counting_allreduce)


spec = importlib.util.spec_from_file_location("probed", script)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
if hasattr(mod, "DDP"):
    mod.DDP = CountingDDP
torch.nn.parallel.DistributedDataParallel = CountingDDP
sys.argv = [script, *argv]
mod.main(*([argv] if mod.main.__code__.co_argcount else []))
print("COMM " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "calls": calls[0]}), flush=True)
