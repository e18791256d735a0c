"""Runs a program's main() and logs every sample index its ResumableSampler hands out, one JSON
line per index: {"rank": R, "world_size": W, "index": I} appended to $SAMPLE_LOG.rank{R}.

    torchrun ... sample_probe.py SCRIPT -- ARGS...

With num_workers=0 the DataLoader asks the sampler for a batch's indices only when it builds
that batch, so a rank killed right after a step has logged exactly the samples it trained on.
"""
import importlib.util
import json
import os
import sys

script, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
spec = importlib.util.spec_from_file_location("probed", script)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
original = mod.ResumableSampler.__iter__


def logged(self):
    path = f"{os.environ['SAMPLE_LOG']}.rank{self.rank}"
    with open(path, "a", encoding="utf-8") as f:
        for index in original(self):
            f.write(json.dumps({"rank": self.rank, "world_size": self.num_replicas, "index": index}) + "\n")
            f.flush()  # a SIGKILL right after a step must not lose what was logged
            yield index


mod.ResumableSampler.__iter__ = logged
sys.argv = [script, *argv]
mod.main(argv)
