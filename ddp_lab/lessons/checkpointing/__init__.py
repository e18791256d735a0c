"""Checkpoints that survive crashes: what to save, how to write it, how to read it back.

    from ddp_lab.lessons import checkpointing as ck
    ck.atomic_save(ck.make_checkpoint(model, optimizer, step=s, epoch=e), "runs/last.pt")
    state = ck.load_on_rank0_and_broadcast("runs/last.pt")   # every rank calls it

- make_checkpoint / restore: everything an exact resume needs, model unwrapped.
- clean_state_dict: strips the `module.` (DDP) and `_orig_mod.` (torch.compile) prefixes.
- naive_save vs atomic_save: a crash during a naive save destroys the only checkpoint;
  temp file + fsync + os.replace keeps the previous one loadable. kill_mid_save proves it.
- load_every_rank (what the engineering article's code does) vs load_on_rank0_and_broadcast (what
  its comment says): N reads of shared storage vs one read plus a broadcast.
- overhead / young_interval / simulate_overhead: how often to save (the engineering article:
  "save every N steps"), and a failure-by-failure simulation to check the model.
"""
from __future__ import annotations

import io
import math
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from ddp_lab.engine.launch import ROOT

# What an exact resume needs, and why (the notebook's table and the tests use this).
MUST_HOLD = {
    "model": "weights of the *unwrapped* model (no module. / _orig_mod. prefix)",
    "optimizer": "Adam moments and step counts; without them the next steps differ",
    "scheduler": "where the learning-rate schedule is",
    "scaler": "fp16 loss scale and its growth tracker (which steps get skipped)",
    "epoch": "the sampler's epoch: DistributedSampler.set_epoch(epoch) picks the shuffle",
    # train_ddp.py steps once per K batches (accumulation), so it saves the position as batch_in_epoch
    "step": "the step counter (logs, LR schedule); one batch per step: where in the epoch to go on",
    "rng": "torch / CUDA / Python RNG states: dropout masks, augmentations",
    "config": "the run's settings, so a resume can refuse an incompatible one",
}
PREFIXES = ("module.", "_orig_mod.")


# ---------------------------------------------------------------- what to save
def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model inside DDP(...) and/or torch.compile(...), in any nesting order."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
            model = model._orig_mod
        else:
            return model


def clean_state_dict(state_dict: dict) -> dict:
    """A copy with every leading `module.` / `_orig_mod.` removed (both orders, repeated)."""
    sd = type(state_dict)(state_dict)  # keep OrderedDict and its _metadata
    if hasattr(state_dict, "_metadata"):
        sd._metadata = type(state_dict._metadata)(state_dict._metadata)
    changed = True
    while changed:
        before = list(sd)
        for prefix in PREFIXES:
            consume_prefix_in_state_dict_if_present(sd, prefix)
        changed = list(sd) != before
    return sd


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def make_checkpoint(model, optimizer=None, scheduler=None, scaler=None, *, epoch=0, step=0,
                    config=None, rng=None) -> dict:
    """Everything in MUST_HOLD. Under DDP pass rng=gathered per-rank states (see gather_rng)."""
    return {
        "model": clean_state_dict(unwrap(model).state_dict()),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "epoch": int(epoch), "step": int(step),
        "rng": rng if rng is not None else rng_state(),
        "config": dict(config or {}),
    }


def restore(ckpt: dict, model, optimizer=None, scheduler=None, scaler=None, skip=()) -> dict:
    """Load a checkpoint into live objects; `skip` leaves parts out (to see what breaks)."""
    if "model" not in skip:
        unwrap(model).load_state_dict(clean_state_dict(ckpt["model"]))
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None and name not in skip and ckpt.get(name) is not None:
            obj.load_state_dict(ckpt[name])
    if "rng" not in skip:
        rng = ckpt["rng"]
        set_rng_state(rng[dist.get_rank()] if isinstance(rng, list) else rng)
    return {k: (0 if k in skip else ckpt[k]) for k in ("epoch", "step")}


def gather_rng() -> list:
    """Each rank's RNG state, gathered so rank 0 can save all of them (its own is not enough)."""
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return states


# ---------------------------------------------------------------- how to write it
def naive_save(obj, path, opener=open) -> None:
    """torch.save straight onto the target: open(..., 'wb') truncates the old file first."""
    with opener(path, "wb") as f:
        torch.save(obj, f)


def atomic_save(obj, path, opener=open) -> None:
    """Write a temp file in the same folder, fsync it, then os.replace (atomic on POSIX):
    readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with opener(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
        if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
            fd = os.open(path.parent, os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a clean failure leaves no litter (a SIGKILL still can)
        raise


def stale_temps(folder) -> list:
    """Temp files a killed atomic_save left behind (safe to delete before the next save)."""
    return sorted(Path(folder).glob(".*.tmp-*"))


class _PausingFile(io.FileIO):
    """A file that stops in the middle of the write that crosses `pause_at` bytes and
    waits to be killed, so a demo can SIGKILL a writer exactly mid-save."""

    def __init__(self, path, mode, pause_at: int):
        super().__init__(path, mode)
        self.pause_at, self.written = pause_at, 0

    def write(self, b) -> int:
        b = memoryview(b).cast("B")
        if self.written + len(b) > self.pause_at:
            head = self.pause_at - self.written
            super().write(b[:head])
            self.written += head
            os.fsync(self.fileno())
            print(f"PAUSED {self.written}", flush=True)  # the parent kills us now
            signal.pause()
        self.written += len(b)
        return super().write(b)


def demo_checkpoint(step: int, megabytes: float = 4.0) -> dict:
    n = int(megabytes * 2**20 / 4)
    return {"step": step, "model": {"w": torch.full((n,), float(step))}}


def kill_mid_save(targets: dict, step: int = 2, megabytes: float = 4.0, fraction: float = 0.5):
    """For each {mode: path} ('naive' or 'atomic'), start a process that saves
    demo_checkpoint(step) to path that way and SIGKILL it once `fraction` of the bytes
    are written (writers run side by side). Returns {mode: (bytes written, full size)}."""
    bad = set(targets) - {"naive", "atomic"}
    if bad:
        raise ValueError(f"modes must be 'naive' or 'atomic', not {sorted(bad)}")
    buf = io.BytesIO()
    torch.save(demo_checkpoint(step, megabytes), buf)
    total = buf.getbuffer().nbytes
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    children, out = {}, {}
    try:
        for mode, path in targets.items():
            cmd = [sys.executable, "-m", "ddp_lab.lessons.checkpointing", mode, str(path), str(step),
                   str(megabytes), str(int(total * fraction))]
            children[mode] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True, env=env)
        for mode, child in children.items():
            line = child.stdout.readline()
            if not line.startswith("PAUSED"):
                raise RuntimeError(f"{mode} writer did not reach the pause: {line!r} {child.stderr.read()}")
            child.kill()  # SIGKILL: no finally, no cleanup, as a lost node or the OOM killer
            out[mode] = (int(line.split()[1]), total)
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
            child.wait()
            child.stdout.close()
            child.stderr.close()
    return out


# ---------------------------------------------------------------- how to read it
class CountingReader(io.RawIOBase):
    """Wraps a binary file and counts the bytes torch.load pulls from storage."""

    def __init__(self, f):
        self.f, self.bytes_read = f, 0

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.bytes_read += n or 0
        return n

    def seek(self, *args) -> int:
        return self.f.seek(*args)

    def tell(self) -> int:
        return self.f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def counted_load(path, map_location="cpu") -> tuple[dict, int]:
    """torch.load (weights_only: a checkpoint is data, not code) plus bytes read."""
    with open(path, "rb") as f:
        reader = CountingReader(f)
        obj = torch.load(io.BufferedReader(reader), map_location=map_location, weights_only=True)
    return obj, reader.bytes_read


def load_every_rank(path, map_location="cpu") -> tuple[dict, int]:
    """What the engineering article's load_checkpoint really does: both branches of its `if` read the file,
    so every rank hits shared storage (N readers; the file must exist on every node)."""
    return counted_load(path, map_location)


def load_on_rank0_and_broadcast(path, src: int = 0, map_location="cpu") -> tuple[dict, int]:
    """What its comment promises: rank `src` reads, everyone else receives it over the
    process group. One read; works when only rank 0's node has the file. Every rank calls it."""
    box, nread = [None], 0
    if dist.get_rank() == src:
        box[0], nread = counted_load(path, map_location)
    # Pickled and sent as one byte tensor (NCCL needs torch.cuda.set_device first).
    dist.broadcast_object_list(box, src=src)
    return box[0], nread


# ---------------------------------------------------------------- how often to save
def overhead(every: float, step_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected fraction of wall time not spent on progress that survives, saving every `every` steps.

    A cycle is `every` steps then a blocking save: L = every * step_s + save_s seconds.
    Failures arrive at random (exponential, mean mtbf_s) and lose everything since the last
    completed save; each costs a restart of restart_s (failure-free). The expected wall time
    to get one cycle done is (mtbf_s + restart_s) * (exp(L / mtbf_s) - 1) (the standard
    result for exponential failures), of which every * step_s is progress. To first order in
    L / mtbf_s this is save_s / (every * step_s) + every * step_s / (2 * mtbf_s) + restart_s / mtbf_s,
    whose minimum is Young's interval.
    """
    interval = every * step_s
    expected = (mtbf_s + restart_s) * math.expm1((interval + save_s) / mtbf_s)
    return 1 - interval / expected


def overhead_first_order(every: float, step_s: float, save_s: float, mtbf_s: float,
                         restart_s: float = 0.0) -> float:
    """overhead() to first order (save_s and the interval small next to mtbf_s)."""
    interval = every * step_s
    return save_s / interval + interval / (2 * mtbf_s) + restart_s / mtbf_s


def young_interval(step_s: float, save_s: float, mtbf_s: float) -> float:
    """Young's optimum (1974): save every sqrt(2 * save_s * mtbf_s) seconds, in steps."""
    return math.sqrt(2 * save_s * mtbf_s) / step_s


def simulate_overhead(every: int, step_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0,
                      failures: int = 10_000, seed: int = 0) -> float:
    """The same job played out failure by failure, to check overhead() against.

    After each (re)start the next failure comes after a random time (exponential, mean
    mtbf_s). Until then the job repeats `every` steps and a save; the steps of every
    completed save survive, the unsaved part is lost, and the restart costs restart_s.
    Returns the fraction of the simulated wall time not spent on surviving steps. The
    same seed draws the same failures for every `every` (common random numbers), so
    intervals can be compared with little noise.
    """
    rng = random.Random(seed)
    cycle = every * step_s + save_s
    wall = useful = 0.0
    for _ in range(failures):
        life = rng.expovariate(1 / mtbf_s)
        useful += math.floor(life / cycle) * every * step_s  # cycles completed (saved) before it fails
        wall += life + restart_s
    return 1 - useful / wall


def lost_steps(crash_step: int, save_every: int) -> int:
    """Steps redone after a crash: those since the last save (saves at save_every, 2*save_every...)."""
    return crash_step - (crash_step // save_every) * save_every

