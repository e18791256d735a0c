"""A real all-reduce between two processes on this machine, timed: `ddp-lab doctor`'s network check.

    python -m ddp_lab.doctor.allreduce RANK WORLD PORT BACKEND MEGABYTES [ADDR]   # what measure() starts

measure() starts WORLD copies of this module, which meet at a TCPStore on 127.0.0.1:PORT,
check that the sum is right, then time ITERS all-reduces of MEGABYTES of float32. Each rank
prints one JSON line. across() starts one copy on this node, as rank NODE_RANK of NNODES: every
node's doctor (--node-rank) meets the others at ADDR:PORT, node 0's, over the link between them. Bus bandwidth is the algorithm bandwidth (bytes / time) times
2(N-1)/N, the bytes each rank really sends in a ring (notebook 03).
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

ITERS = 5
WORKER_TIMEOUT_S = 60  # to meet the other rank (it may still be importing torch) and for each collective
PEER_TIMEOUT_S = 120   # across nodes: someone starts the doctor on each machine


def measure(world: int = 2, backend: str = "gloo", megabytes: float = 16, timeout: float = 90) -> dict:
    """Run the all-reduce in `world` fresh processes; {'ok', 'busbw_gbs', 'algbw_gbs', 'seconds', 'error'}.

    A rank that cannot reach the other fails by itself after WORKER_TIMEOUT_S (with the store's or
    gloo's message); `timeout` only backs that up, generous because importing torch in two fresh
    processes takes seconds on a laptop and much longer on a machine that is busy with other jobs.
    """
    from ddp_lab.engine.launch import free_port
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "ddp_lab.doctor.allreduce", str(r), str(world), str(port),
                               backend, str(megabytes)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL) for r in range(world)]
    outs, deadline = [], time.time() + timeout
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.time())))
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no result within {timeout:g} s (a stuck rank? a machine too busy?)"}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        err = next(e for p, (_, e) in zip(procs, outs) if p.returncode)
        return {"ok": False, "error": (err.strip().splitlines() or ["exit code non-zero"])[-1][:300]}
    return {"ok": True, **json.loads(outs[0][0].strip().splitlines()[-1])}


def across(node_rank: int, nnodes: int, addr: str, port: int, megabytes: float = 4,
           timeout: float = PEER_TIMEOUT_S) -> dict:
    """This node's rank of a gloo all-reduce with the doctors of the other nodes, met at addr:port
    (node 0's): {'ok', 'busbw_gbs', ...} or {'ok': False, 'error'}. Every node must start its doctor
    within `timeout` seconds of the others."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDP_LAB_DOCTOR_WAIT_S": str(timeout)}
    p = subprocess.Popen([sys.executable, "-m", "ddp_lab.doctor.allreduce", str(node_rank), str(nnodes), str(port),
                          "gloo", str(megabytes), addr], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, stdin=subprocess.DEVNULL)
    try:
        out, err = p.communicate(timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return {"ok": False, "error": f"no result within {timeout + 60:g} s"}
    if p.returncode:
        return {"ok": False, "error": (err.strip().splitlines() or ["exit code non-zero"])[-1][:300]}
    return {"ok": True, **json.loads(out.strip().splitlines()[-1])}


def same_torch(store, rank: int, world: int) -> None:
    """Every rank puts its torch version in the store and reads the others': different versions
    across nodes fail or hang in ways that do not name the cause (pickled objects, collectives)."""
    import torch
    store.set(f"ddp_lab_doctor/torch/{rank}", torch.__version__)
    versions = {r: store.get(f"ddp_lab_doctor/torch/{r}").decode() for r in range(world)}
    if len(set(versions.values())) > 1:
        raise RuntimeError("torch differs across the nodes: " + ", ".join(
            f"node {r} has torch {v}" for r, v in versions.items()))


def worker(rank: int, world: int, port: int, backend: str, megabytes: float, addr: str = "127.0.0.1") -> None:
    import torch
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=float(os.environ.get("DDP_LAB_DOCTOR_WAIT_S", WORKER_TIMEOUT_S)))
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout)
    same_torch(store, rank, world)
    local_rank = rank   # every rank runs on this machine; on a cluster it is LOCAL_RANK, never RANK
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    bound = {}
    if backend == "nccl":
        torch.cuda.set_device(device)
        bound = {"device_id": device}   # NCCL binds this GPU at once, and barrier() knows it
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **bound)
    try:
        x = torch.full((1,), float(rank + 1), device=device)
        dist.all_reduce(x)
        if x.item() != world * (world + 1) / 2:
            raise RuntimeError(f"all_reduce returned {x.item()}, expected {world * (world + 1) / 2}")
        data = torch.ones(int(megabytes * 2**20 / 4), device=device)
        dist.all_reduce(data)                            # warm-up: connections, buffers
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(ITERS):
            dist.all_reduce(data)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / ITERS
        algbw = data.numel() * 4 / seconds / 1e9
        # every rank prints: across nodes, each node's doctor reports what it measured
        print(json.dumps({"seconds": seconds, "megabytes": megabytes, "world": world, "backend": backend,
                          "algbw_gbs": algbw, "busbw_gbs": algbw * 2 * (world - 1) / world}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    r, w, p, b, mb = sys.argv[1:6]
    worker(int(r), int(w), int(p), b, float(mb), *sys.argv[6:7])
