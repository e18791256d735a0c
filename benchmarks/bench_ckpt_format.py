"""Checkpoint formats of scripts/train_ddp.py side by side: --ckpt-format pt against dcp.

    .venv/bin/python benchmarks/bench_ckpt_format.py [--params-m 20] [--reps 3]

One 2-rank gloo job on this machine. Every rank builds the same model of --params-m million
float32 parameters (square Linear layers) and its Adam state after one step, then, for each
repetition and each format in turn, calls train_ddp.py's own save_checkpoint() (pt: rank 0
writes last.pt; dcp: every rank writes its part of the folder last.dcp) and resume() (pt: every
rank reads the whole file; dcp: every rank reads the parts it needs), with a barrier before each
timed call. Prints the size on disk, the bytes each rank wrote, the median seconds of each call
(the slowest rank's) and the dcp/pt ratios; asserts nothing.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FORMATS = ("pt", "dcp")


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size


def worker(folder: str, params_m: int, reps: int) -> None:
    """One rank: build the model, then save and resume it in both formats, timing each call."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401  train_ddp.py imports it lazily: not inside a timed call
    from torch import nn

    spec = importlib.util.spec_from_file_location("train_ddp_bench", ROOT / "scripts" / "train_ddp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dist.init_process_group("gloo")
    rank, device = dist.get_rank(), torch.device("cpu")
    width = 2048
    torch.manual_seed(0)  # the same weights on every rank, as DDP keeps them
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(max(1, round(params_m * 1e6 / width**2)))])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(1, width)).sum().backward()
    optimizer.step()  # Adam's exp_avg and exp_avg_sq: the checkpoint holds three copies of the weights
    stateful = {"model": model, "optimizer": optimizer,
                "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                "scaler": torch.amp.GradScaler("cpu", enabled=False)}
    run_spec = {"model": "bench_ckpt_format"}
    times = {f"{fmt} {call}": [] for fmt in FORMATS for call in ("save", "load")}
    for rep in range(reps):
        for fmt in FORMATS:
            path = os.path.join(folder, f"last.{fmt}")
            config = {"ckpt_format": fmt, "world_size": dist.get_world_size(), "batch_size": 1, "accum_steps": 1}
            dist.barrier()
            t = time.perf_counter()
            mod.save_checkpoint(path, stateful, (0, 0, rep + 1), run_spec, config, device, None)
            times[f"{fmt} save"].append(time.perf_counter() - t)
            args = argparse.Namespace(resume=path, ckpt_dir=None, ckpt_format=fmt, batch_size=1, accum_steps=1)
            dist.barrier()
            t = time.perf_counter()
            mod.resume(args, rank, dist.get_world_size(), run_spec, stateful, device, 1)
            times[f"{fmt} load"].append(time.perf_counter() - t)
    Path(folder, f"times.rank{rank}").write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-m", type=int, default=20, help="million parameters in the model (default 20)")
    p.add_argument("--reps", type=int, default=3, help="saves and loads per format, alternating (default 3)")
    p.add_argument("--worker", nargs=3, metavar=("FOLDER", "PARAMS_M", "REPS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker[0], int(a.worker[1]), int(a.worker[2]))

    import torch

    from ddp_lab.engine import launch

    with tempfile.TemporaryDirectory(prefix="bench_ckpt_format_") as tmp:
        launch.torchrun(str(Path(__file__).resolve()), nproc=2, stream=False, timeout=900,
                        args=["--worker", tmp, str(a.params_m), str(a.reps)])
        size = {fmt: disk_bytes(Path(tmp, f"last.{fmt}")) for fmt in FORMATS}
        parts = sorted((f.name, f.stat().st_size) for f in Path(tmp, "last.dcp").iterdir())
        ranks = [json.loads(Path(tmp, f"times.rank{r}").read_text()) for r in range(2)]
    mib = lambda b: b / 2**20
    median = lambda xs: sorted(xs)[len(xs) // 2]
    # a call ends for the job when its slowest rank is done: per repetition, the max over ranks
    secs = {k: median([max(r[k][i] for r in ranks) for i in range(a.reps)]) for k in ranks[0]}
    print(f"{a.params_m} M parameters + Adam state; torch {torch.__version__}, 2 ranks, gloo, "
          f"{os.cpu_count()} CPUs, {a.reps} saves and loads per format (median)")
    print(f"\n{'format':<7} {'on disk':>10} {'save s':>8} {'load s':>8}")
    for fmt in FORMATS:
        print(f"{fmt:<7} {mib(size[fmt]):>6.1f} MiB {secs[fmt + ' save']:>8.2f} {secs[fmt + ' load']:>8.2f}")
    print("\nlast.dcp/ holds: " + ", ".join(f"{name} {mib(b):.1f} MiB" for name, b in parts))
    print(f"dcp / pt: size {size['dcp'] / size['pt']:.3f}, save time {secs['dcp save'] / secs['pt save']:.2f}, "
          f"load time {secs['dcp load'] / secs['pt load']:.2f}")


if __name__ == "__main__":
    main()
