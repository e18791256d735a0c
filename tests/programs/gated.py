"""Runs a program's main() with a gate the test controls, to stop training at a chosen step:

    torchrun ... gated.py SCRIPT -- ARGS...        ($GATE: a file holding a step number N)

Before each optimizer step, while $GATE exists and holds N <= the steps already taken, every rank
waits. Steps are read from the optimizer's own state (AdamW's per-parameter "step", restored
from a checkpoint on resume), so the gate counts global steps across restarts. Deleting the
file lets training run to the end; writing a larger N (atomically: write, then rename) lets it
run to step N.
"""
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

script, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
gate = Path(os.environ["GATE"])


def wait_at_gate(optimizer, args, kwargs):
    states = list(optimizer.state.values())
    done = int(states[0]["step"]) if states else 0
    while True:
        try:
            if done < int(gate.read_text()):
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)


register_optimizer_step_pre_hook(wait_at_gate)
spec = importlib.util.spec_from_file_location("gated", script)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
sys.argv = [script, *argv]
mod.main(argv)
