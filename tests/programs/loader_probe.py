"""Runs a program's main() with every DataLoader it builds recorded, and prints them:

    python loader_probe.py SCRIPT -- ARGS...   ->  "LOADERS [{"workers": N, "persistent": bool, "epochs": E}, ...]"

`epochs` counts the iterations over each loader, so a test can see a persistent loader iterated
more than once (its workers then serve every epoch).
"""
import importlib.util
import json
import sys

import torch.utils.data

script, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
seen = []


class RecordedLoader(torch.utils.data.DataLoader):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
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
print("LOADERS " + json.dumps(seen), flush=True)
