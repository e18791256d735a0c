"""Peak memory of a resume in scripts/train_ddp.py: every rank reads the file, or rank 0 sends it.

    .venv/bin/python benchmarks/bench_resume.py [--params-m 50] [--reps 1]

Builds a checkpoint of a model of --params-m million float32 parameters (square Linear layers)
with its Adam state (twice the parameters again) in a temporary folder, in train_ddp.py's
format. Then, for each path and repetition, a fresh 2-rank gloo job on this machine calls
train_ddp.py's own resume_state() on it once:
  shared: every rank sees the file and reads it itself (torch.load, map_location="cpu");
  sent:   rank 1 is made to see no file (its fingerprint is None), so rank 0 reads it and
          sends it with broadcast_object_list (the only path before shared storage was detected).
Each rank reports its peak RSS (VmHWM from /proc/self/status) before and after the call; the
table shows the peak added by the resume (after - before), and the time the call took. Prints
the table and the ratio of rank 0's peaks; asserts nothing.
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
SPEC = {"model": "bench_resume"}  # what read_checkpoint compares: the worker passes the same


def vm(field: str) -> int:
    """A /proc/self/status field in bytes (VmHWM: peak resident memory, VmRSS: resident now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def write_checkpoint(path: Path, params_m: int) -> int:
    """A train_ddp.py-format checkpoint: the model, its Adam state after one step, and the rest."""
    import torch
    from torch import nn

    width = 2048
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(1, width)).sum().backward()
    optimizer.step()  # creates exp_avg and exp_avg_sq: the checkpoint holds three copies of the weights
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1, "epoch": 0,
                "samples_in_epoch": 0, "rng": [], "spec": SPEC, "config": {}}, path)
    return sum(p.numel() for p in model.parameters())


def worker(mode: str, ckpt: str, out: str) -> None:
    """One rank of the job: resume_state() once, its peak memory before and after."""
    import torch
    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("train_ddp_bench", ROOT / "scripts" / "train_ddp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "sent" and rank != 0:
        mod.file_fingerprint = lambda path: None  # a node without the shared filesystem
    args = argparse.Namespace(resume=ckpt, ckpt_dir=None)
    dist.barrier()
    before, rss = vm("VmHWM"), vm("VmRSS")
    start = time.perf_counter()
    state, _, reader = mod.resume_state(args, rank, SPEC, torch.device("cpu"))
    seconds = time.perf_counter() - start
    after = vm("VmHWM")
    tensors = sum(t.numel() * t.element_size() for t in state["model"].values())
    Path(f"{out}.rank{rank}").write_text(json.dumps({
        "rank": rank, "mode": mode, "reader": reader, "hwm_before": before, "rss_before": rss,
        "hwm_after": after, "seconds": seconds, "model_bytes": tensors}))
    del state
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-m", type=int, default=50, help="million parameters in the model (default 50)")
    p.add_argument("--reps", type=int, default=1, help="jobs per path, alternating (default 1)")
    p.add_argument("--worker", nargs=3, metavar=("MODE", "CKPT", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(*a.worker)

    import torch

    from ddp_lab.engine import launch

    with tempfile.TemporaryDirectory(prefix="bench_resume_") as tmp:
        ckpt = Path(tmp) / "last.pt"
        n = write_checkpoint(ckpt, a.params_m)
        size = ckpt.stat().st_size
        print(f"checkpoint: {n / 1e6:.1f} M parameters + Adam state, {size / 2**20:.0f} MiB "
              f"(torch {torch.__version__}, 2 ranks, gloo, {os.cpu_count()} CPUs)")
        results = {"shared": [], "sent": []}
        for rep in range(a.reps):
            for mode in results:
                out = Path(tmp) / f"{mode}{rep}"
                launch.torchrun(str(Path(__file__).resolve()), nproc=2, stream=False, timeout=600,
                                args=["--worker", mode, str(ckpt), str(out)])
                results[mode].append([json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)])
    mib = lambda b: b / 2**20
    print(f"\n{'path':<8} {'who reads':<11} {'rank':>4} {'RSS before':>11} {'peak added':>11} {'seconds':>8}")
    peaks = {}
    for mode, reps in results.items():
        for rank in range(2):
            rows = [rep[rank] for rep in reps]
            added = sorted(r["hwm_after"] - r["hwm_before"] for r in rows)[len(rows) // 2]  # the median
            secs = sorted(r["seconds"] for r in rows)[len(rows) // 2]
            peaks[mode, rank] = added
            print(f"{mode:<8} {rows[0]['reader']:<11} {rank:>4} {mib(rows[0]['rss_before']):>8.0f} MiB "
                  f"{mib(added):>7.0f} MiB {secs:>8.2f}")
    print(f"\nrank 0's peak added by the resume: sent / shared = {peaks['sent', 0] / peaks['shared', 0]:.2f}; "
          f"in units of the checkpoint's size: shared {peaks['shared', 0] / size:.2f}, "
          f"sent {peaks['sent', 0] / size:.2f} (rank 1: {peaks['shared', 1] / size:.2f}, {peaks['sent', 1] / size:.2f})")


if __name__ == "__main__":
    main()
