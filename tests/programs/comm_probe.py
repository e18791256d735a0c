"""Runs a program's main() with every DDP model counting its gradient all-reduces
(ddp_lab.lessons.accumulation.AllReduceCounter, the counter notebook 05 uses), and prints the count:

    torchrun ... comm_probe.py SCRIPT -- ARGS...      ->  "COMM {"rank": R, "calls": N}"
                                                          "VIEWS {"rank": R, "buckets": N, "in_bucket": K}"

One call per gradient bucket per synchronising backward: no_sync() micro-steps add none. VIEWS counts
the buckets handed to the hook (N) and those whose every parameter's .grad, read there, lives in the
bucket's own storage (K): K == N when DDP keeps the gradients as views into its buckets
(gradient_as_bucket_view=True), K == 0 when each .grad has storage of its own (notebook 11 §1).
"""
import importlib.util
import json
import os
import sys

import torch.nn.parallel
from torch.nn.parallel import DistributedDataParallel

from ddp_lab.lessons.accumulation import AllReduceCounter

script, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
counters, in_bucket = [], []  # in_bucket: one bool per bucket handed to a comm hook


class CountingDDP(DistributedDataParallel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        counters.append(AllReduceCounter(self))

    def register_comm_hook(self, state, hook):
        def checked(state, bucket):  # DDP calls the hook once every gradient of the bucket is in it
            storage = bucket.buffer().untyped_storage().data_ptr()
            in_bucket.append(all(p.grad is not None and p.grad.untyped_storage().data_ptr() == storage
                                 for p in bucket.parameters()))
            return hook(state, bucket)
        super().register_comm_hook(state, checked)


spec = importlib.util.spec_from_file_location("probed", script)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
if hasattr(mod, "DDP"):
    mod.DDP = CountingDDP
torch.nn.parallel.DistributedDataParallel = CountingDDP
sys.argv = [script, *argv]
mod.main(*([argv] if mod.main.__code__.co_argcount else []))
calls = sum(c.calls for c in counters)
print("VIEWS " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "buckets": len(in_bucket),
                             "in_bucket": sum(in_bucket)}), flush=True)
print("COMM " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "calls": calls}), flush=True)  # the last line
