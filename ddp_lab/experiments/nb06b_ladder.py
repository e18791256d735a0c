"""Notebook 06b: every rung of the script ladder trains, one after the other, in one launch.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb06b_ladder --epochs 1

Each rung's own train(args, rank, world_size, device, backend) runs on this program's process
group (one launch instead of nine: each torchrun start costs seconds), with its features off
(rungs 4 and up: --lr-schedule constant, since the cosine schedule is on by default). Rungs 2 and up write
their JSON-lines records to OUT/rungK.jsonl; rung 1 prints its epoch losses. Every rank records
kind="weights" (rung, params_sha256): a sha256 of the final weights of the model each rung wrapped in
DDP (only train_ddp.py records its own), so the rungs can be compared weight for weight. The test
suite launches every rung file on its own, as you would (tests/test_ladder.py).
"""
import argparse
import gc
import hashlib
import importlib.util
import os
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from ddp_lab.lessons import ladder
from ddp_lab.engine import runtime


def load(rung):
    spec = importlib.util.spec_from_file_location(Path(rung.file).stem, ladder.path(rung))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # safe: a rung runs main() only under __main__
    return module


def params_sha256(model) -> str:
    """sha256 over every state_dict tensor's bytes, in order: train_ddp.py's own fingerprint."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--out", required=True, help="folder for rungK.jsonl and rung 1's weights")
    args = p.parse_args()
    os.environ["MINIMAL_DDP_OUT"] = os.path.join(args.out, "minimal_ddp.pt")
    with runtime.distributed() as ctx:
        for k, rung in enumerate(ladder.RUNGS, 1):
            ctx.print0(f"--- rung {k}: {rung.file}")
            module = load(rung)
            wrapped = []  # the model the rung hands to DDP, kept to fingerprint its final weights

            def keep(model, *a, **kw):
                wrapped.append(model)
                return DistributedDataParallel(model, *a, **kw)
            module.DDP = keep  # every rung does `from torch.nn.parallel import DistributedDataParallel as DDP`
            flags = ["--epochs", str(args.epochs)]
            if k > 1:
                flags += ["--metrics-out", os.path.join(args.out, f"rung{k}.jsonl"), "--log-every", "10"]
            if k >= 4:  # features off: rung 4's cosine schedule is on by default
                flags += ["--lr-schedule", "constant"]
            module.train(module.parse_args(flags), ctx.rank, ctx.world_size, ctx.device, ctx.backend)
            (model,) = wrapped
            ctx.record(kind="weights", rung=k, params_sha256=params_sha256(model))
            del module, model, wrapped, keep
            gc.collect()  # this rung's DDP model is gone before the next one is built


if __name__ == "__main__":
    main()
