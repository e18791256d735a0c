"""Runs a program's main() with every DataLoader it builds recorded, and prints them:

    python loader_probe.py SCRIPT -- ARGS...
        ->  "LOADERS [{"workers": N, "persistent": bool, "epochs": E, "started": S}, ...]"   (in the order built)

`epochs` counts the iterations over each loader and `started` the worker processes it started (each
one writes a line from its worker_init_fn): a persistent loader iterated E times starts N workers, a
loader that is not starts N x E.
"""
import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile

import torch.utils.data

script, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
seen = []
starts = tempfile.mkdtemp(prefix="loader_probe_")  # one file per loader, a line per worker started


def worker_started(path, worker_id):
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


class RecordedLoader(torch.utils.data.DataLoader):
    def __init__(self, *args, **kwargs):
        assert "worker_init_fn" not in kwargs  # the probe's own would replace the program's
        # a partial, not a lambda over self: a loader that refers to itself outlives the program, and its
        # persistent worker is then stopped at interpreter exit, after torch's 5 s join timeout
        super().__init__(*args, worker_init_fn=functools.partial(worker_started, os.path.join(starts, str(len(seen)))),
                         **kwargs)
        self.record = {"workers": self.num_workers, "persistent": self.persistent_workers, "epochs": 0}
        seen.append(self.record)

    def __iter__(self):
        self.record["epochs"] += 1
        return super().__iter__()


spec = importlib.util.spec_from_file_location("probed", script)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
mod.DataLoader = RecordedLoader
sys.argv = [script, *argv]
mod.main(*([argv] if mod.main.__code__.co_argcount else []))
for k, record in enumerate(seen):
    path = os.path.join(starts, str(k))
    record["started"] = len(open(path).read().split()) if os.path.exists(path) else 0
shutil.rmtree(starts)
print("LOADERS " + json.dumps(seen), flush=True)
