"""All-reduce bandwidth sweep, in the spirit of nccl-tests' all_reduce_perf.

    python scripts/allreduce_bench.py                                  # world of one
    torchrun --standalone --nproc_per_node=2 scripts/allreduce_bench.py
    torchrun --standalone --nproc_per_node=4 scripts/allreduce_bench.py \
        --min-bytes 1K --max-bytes 256M --json-out bench.json
    # two machines: torchrun --nnodes=2 --node_rank=R --master_addr=HOST \
    #               --master_port=29500 --nproc_per_node=G scripts/allreduce_bench.py

For each size S it times `iters` all_reduce(SUM) calls after `warmup` untimed ones
and prints, like nccl-tests:
    time  = the slowest rank's mean time per call (a collective ends when its last rank does)
    algbw = S / time
    busbw = algbw * 2(n-1)/n  (undoes the ring's 2(n-1)/n traffic factor: the link
                               speed, comparable across n; 0 for a world of one)
Backend from the device: NCCL on GPUs (one per rank), gloo on CPU. Uses only torch and the stdlib.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import sys
import time

import torch
import torch.distributed as dist

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?B?)\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (write e.g. 4096, 64K, 16M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Time dist.all_reduce over a sweep of sizes.")
    p.add_argument("--min-bytes", type=parse_size, default="4K", help="smallest size (default 4K)")
    p.add_argument("--max-bytes", type=parse_size, default="16M", help="largest size (default 16M)")
    p.add_argument("--factor", type=int, default=4, help="size multiplier between steps (default 4)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per size first (default 5)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--json-out", default=None, help="rank 0 writes the results here as JSON")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: GPUs with NCCL when every local rank has its own GPU, else CPU with gloo")
    args = p.parse_args(argv)
    problems = []
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        problems.append("--min-bytes must be at least 1 and at most --max-bytes")
    if args.factor < 2:
        problems.append("--factor must be 2 or more")
    if args.iters < 1 or args.warmup < 0:
        problems.append("--iters must be at least 1 and --warmup at least 0")
    if args.json_out:
        folder = os.path.dirname(os.path.abspath(args.json_out))
        if not os.path.isdir(folder):
            problems.append(f"--json-out: folder {folder} does not exist; create it first")
    if args.device == "cuda" and not torch.cuda.is_available():
        problems.append("--device cuda: no GPU is visible; use --device cpu or auto")
    if problems:
        p.error("; ".join(problems))  # exits with code 2 before anything runs or is written
    return args


def setup(device_choice: str = "auto"):
    """Join torchrun's group, or make a world of one; NCCL on GPUs, else gloo on CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # NCCL needs a GPU per rank; with fewer GPUs than ranks on this node, measure gloo on CPU.
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.device_count() >= local_world)
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    timeout = datetime.timedelta(seconds=float(os.environ.get("BENCH_TIMEOUT", 120)))
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=timeout)
    return backend, device


def sizes(args) -> list:
    out, s = [], args.min_bytes
    while s <= args.max_bytes:
        out.append(s)
        s *= args.factor
    return out


def time_all_reduce(x, iters, warmup, device) -> float:
    """Slowest rank's mean seconds per all_reduce."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        dist.all_reduce(x)
    sync()
    dist.barrier()  # everyone starts the clock together
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    sync()
    mean = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return mean.item()


def main(argv=None) -> None:
    args = parse_args(argv)
    backend, device = setup(args.device)
    rank, n = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    item = torch.tensor([], dtype=dtype).element_size()
    results = []
    try:
        if rank == 0:
            print(f"# all_reduce sum, {n} ranks, backend {backend}, device {device.type}, dtype {args.dtype}, "
                  f"{args.warmup} warmup + {args.iters} timed calls per size", flush=True)
            print(f"{'size(B)':>12} {'count':>10} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}",
                  flush=True)
        for nbytes in sizes(args):
            count = max(1, nbytes // item)
            x = torch.ones(count, dtype=dtype, device=device)
            t = time_all_reduce(x, args.iters, args.warmup, device)
            real = count * item
            algbw = real / t
            busbw = algbw * 2 * (n - 1) / n
            results.append({"bytes": real, "count": count, "time_s": t, "algbw": algbw, "busbw": busbw})
            if rank == 0:
                print(f"{real:>12} {count:>10} {t * 1e6:>11.1f} {algbw / 1e9:>12.3f} {busbw / 1e9:>12.3f}",
                      flush=True)
        if rank == 0 and results:
            avg = sum(r["busbw"] for r in results) / len(results)
            print(f"# average busbw: {avg / 1e9:.3f} GB/s", flush=True)
        if rank == 0 and args.json_out:
            doc = {"world_size": n, "backend": backend, "device": device.type, "dtype": args.dtype,
                   "iters": args.iters, "warmup": args.warmup, "results": results}
            tmp = args.json_out + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
            os.replace(tmp, args.json_out)  # whole file or nothing
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
