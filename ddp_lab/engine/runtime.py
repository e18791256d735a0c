"""The few lines every program that torchrun starts needs.

    from ddp_lab.engine import runtime

    with runtime.distributed() as ctx:        # init (or world size 1 when unlaunched)
        x = torch.ones(1, device=ctx.device) * ctx.rank
        dist.all_reduce(x)
        ctx.print0("sum of ranks:", x.item())  # rank 0 prints
        ctx.record(kind="sum", value=x.item()) # a JSON line for the notebook
                                               # teardown happens in `finally`

- Device and backend: CUDA + NCCL (with torch.cuda.set_device(local_rank)) when
  there is a GPU for every process on this node, else CPU + gloo. DDP_LAB_BACKEND overrides.
- Every collective has a timeout (60 s, DDP_LAB_TIMEOUT overrides), so a lost rank fails
  loudly instead of hanging forever. Init waits at least 60 s for every rank: on a busy
  machine one rank can take many seconds longer than another just to import torch, and a
  short collective timeout must not turn that into a failed start.
- Run as plain `python prog.py` it is a world of one, with a real process group,
  so the same collectives work unchanged.
- Records go to $DDP_LAB_RECORDS/rank{RANK}.jsonl (set by ddp_lab.engine.launch);
  without that variable record() does nothing.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import json
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

RECORDS_ENV = "DDP_LAB_RECORDS"
TIMEOUT_ENV = "DDP_LAB_TIMEOUT"
BACKEND_ENV = "DDP_LAB_BACKEND"
DEFAULT_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_backend(local_world_size: int | None = None) -> tuple[str, str]:
    """(backend, device type): nccl/cuda when this node has a GPU for every process, else gloo/cpu.
    local_world_size: processes on this node (default: torchrun's LOCAL_WORLD_SIZE, else 1).

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so with fewer GPUs than local
    processes the job runs on the CPU over gloo; forcing nccl then is an error that names the fix.
    scripts/train_ddp.py's pick_device makes the same decision (tests/test_runtime.py compares them).
    """
    forced = os.environ.get(BACKEND_ENV) or None
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if forced == "nccl" and gpus < local_world_size:
        raise RuntimeError(f"{BACKEND_ENV}=nccl, but {local_world_size} processes on this node and {gpus} "
                           f"GPU(s): NCCL needs one GPU per process; launch nproc={max(gpus, 1)} or unset "
                           f"{BACKEND_ENV}")
    if forced in (None, "nccl") and gpus >= local_world_size and gpus > 0:
        return "nccl", "cuda"
    return (forced or "gloo"), "cpu"


@dataclass
class Context:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    launched: bool  # True under torchrun, False for a plain `python prog.py`

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print0(self, *args, **kwargs) -> None:
        """print() on rank 0 only; reduce first if the value differs per rank."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def record(self, **fields) -> None:
        """Append one JSON line for the launcher; every rank may call it."""
        folder = os.environ.get(RECORDS_ENV)
        if not folder:
            return
        fields = {"rank": self.rank, "t": time.time(), **fields}
        path = os.path.join(folder, f"rank{self.rank}.jsonl")
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(fields, default=_jsonable) + "\n")


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, torch.device):
        return str(x)
    return str(x)


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def setup(timeout: float | None = None) -> Context:
    """Join the process group torchrun described, or make a world of one."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend, device_type = pick_backend()
    if device_type == "cuda":
        # Before init: NCCL binds this process to its own GPU, not everyone to GPU 0.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    # NCCL binds this GPU at init (without device_id every barrier() warns it is guessing the GPU)
    device_id = device if device.type == "cuda" else None
    # With NCCL, gloo beside it for CPU tensors: the lessons build DDP around CPU models in a
    # kernel's world of one, and NCCL alone refuses them ("No backend type associated with
    # device type cpu", seen on a GPU machine). CUDA tensors still go over NCCL.
    group_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
    limit = datetime.timedelta(seconds=timeout if timeout is not None else timeout_s())
    set_timeout = _timeout_setter()  # init may then wait longer than each collective
    startup = max(limit, datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)) if set_timeout else limit
    if not dist.is_initialized():
        if launched:
            store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=startup))
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # torchrun's agent keeps this store across restarts (--max-restarts): a fresh key
                # space per attempt, or restarted workers may read the dead workers' addresses and
                # fail to connect. Elastic jobs that nodes join set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
                # (a new store every round; the agents' restart counts then differ).
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                store = dist.PrefixStore(f"attempt{attempt}/", store)
            dist.init_process_group(group_backend, store=store, rank=rank, world_size=world_size,
                                    timeout=startup, device_id=device_id)
        else:
            dist.init_process_group(
                group_backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                rank=0, world_size=1, timeout=startup, device_id=device_id)
        if set_timeout:
            set_timeout(limit)  # from here on, every collective
    return Context(rank, world_size, local_rank, local_world_size, device, backend, launched)


def _timeout_setter():
    """dist.set_timeout (newer torch), its older private name, or None where neither exists."""
    from torch.distributed import distributed_c10d
    return getattr(dist, "set_timeout", None) or getattr(distributed_c10d, "_set_pg_timeout", None)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed(timeout: float | None = None):
    """setup() ... teardown(), however the block ends, so a failing rank still releases the group.

    A DDP model (and the gloo state it holds) must be freed before destroy_process_group: freed
    during interpreter exit instead, it can abort a rank that finished its work ("terminate
    called without an active exception", SIGABRT). What kept models alive that long was a
    reference cycle: torch's first optimizer lazily imports torch._dynamo, and during that import
    torch.fx.wrap keeps its own frame in a local, a reference cycle that pins every frame
    then on the stack, so a model local to a function outlived the function's return until the
    cycle collector ran. The gc.collect() before teardown frees it while the group still exists.
    Seen with torch 2.14.1; harmless where the cycle is gone.

    A rank of a launched job that fails with an error releases the group at exit instead, after
    Python has printed its traceback: released first, it would wake the other ranks' waiting
    collectives with "Connection closed", and torchrun, seeing one of them exit first, can stop
    this rank before its traceback is out, so the log would name a secondary error as the cause.
    """
    ctx = setup(timeout)
    try:
        yield ctx
    except Exception:
        if ctx.launched:
            atexit.register(_release, printed=True)  # runs after sys.excepthook printed the traceback
        else:
            _release()
        raise
    except BaseException:  # SystemExit, KeyboardInterrupt: nothing to print first
        _release()
        raise
    else:
        _release()


def _release(printed: bool = False) -> None:
    if printed:  # the printed error's frames hold the models: free them while the group exists
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                setattr(sys, name, None)
    sys.stdout.flush()
    gc.collect()  # what reference cycles still hold (see above), freed while the group exists
    teardown()


def all_reduce_mean(sum_and_count: list[float], device: torch.device | str = "cpu") -> float:
    """Global mean from per-rank [sum, count]: every rank must call it."""
    t = torch.tensor(sum_and_count, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return (t[0] / t[1]).item() if t[1] > 0 else float("nan")
