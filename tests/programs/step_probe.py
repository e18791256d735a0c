"""Run a ladder script unchanged, watching it from outside: python step_probe.py SCRIPT [script args].

The script is imported as a module and its pieces are wrapped, not edited:
- NAN_STEP=K (and NAN_RANK, default 1): that rank's training loss becomes NaN during optimizer step K;
- RANK0_LATE_S=T: rank 0 starts T seconds late, as a rank slow to import torch on a busy machine;
- every rank records the steps its optimizer_step skipped, how often gradients were clipped, and a
  sha256 of its whole model (weights and buffers) when each evaluation starts and at the end.
At exit each rank prints one line: PROBE {"rank": ..., "skipped": [...], ...}.
"""
import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

script = Path(sys.argv[1])
if not script.is_absolute():
    script = Path(__file__).resolve().parents[2] / "scripts" / script
spec = importlib.util.spec_from_file_location("probed", script)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)

rank = int(os.environ.get("RANK", 0))
nan_step, nan_rank = int(os.environ.get("NAN_STEP", 0)), int(os.environ.get("NAN_RANK", 1))
seen = {"rank": rank, "skipped": [], "steps": 0, "clips": 0, "eval_sha": [], "final_sha": None}


def sha(model):
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


real_step, real_clip = mod.optimizer_step, mod.nn.utils.clip_grad_norm_


def optimizer_step(*args, **kwargs):
    norm, skipped = real_step(*args, **kwargs)
    seen["steps"] += 1
    if skipped:
        seen["skipped"].append(seen["steps"])
    return norm, skipped


def clip(*args, **kwargs):
    seen["clips"] += 1
    return real_clip(*args, **kwargs)


def cross_entropy(out, y, *args, **kwargs):
    loss = torch.nn.functional.cross_entropy(out, y, *args, **kwargs)
    training = kwargs.get("reduction", "mean") == "mean"  # evaluation sums
    if training and rank == nan_rank and seen["steps"] + 1 == nan_step:
        loss = loss * float("nan")  # keeps the graph: backward sends NaN into this rank's gradients
    return loss


real_evaluate = mod.evaluate


def evaluate(model, *args, **kwargs):
    seen["eval_sha"].append(sha(model))
    return real_evaluate(model, *args, **kwargs)


real_digest = getattr(mod, "params_sha256", sha)


def params_sha256(model):
    seen["final_sha"] = sha(model)
    return real_digest(model)


mod.optimizer_step, mod.evaluate, mod.params_sha256 = optimizer_step, evaluate, params_sha256
mod.nn = SimpleNamespace(**{**vars(torch.nn), "utils": SimpleNamespace(**{**vars(torch.nn.utils),
                                                                       "clip_grad_norm_": clip})})
mod.F = SimpleNamespace(**{**vars(torch.nn.functional), "cross_entropy": cross_entropy})
if rank == 0:
    time.sleep(float(os.environ.get("RANK0_LATE_S", 0)))
try:
    mod.main(sys.argv[2:])
finally:
    print("PROBE " + json.dumps(seen), flush=True)
