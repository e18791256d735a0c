"""Start a real multi-process job from a notebook cell, safely.

    from ddp_lab import launch
    run = launch.torchrun("-m ddp_lab.experiments.hello", nproc=2)
    run.records          # JSON lines the ranks wrote, each with a "rank" field

Why not `!torchrun prog.py` in a cell? A failing `!` command does not fail the
cell, `torchrun` may not be on PATH (or may belong to another Python), the
cell's interrupt button does not reach the workers, and a kernel restart
leaves them running. This module instead:

- runs `sys.executable -m torch.distributed.run` (the kernel's own Python);
- streams every rank's output live, one whole line at a time, as `[rank N] ...`;
- gives each launch its own port (`--standalone`, or a free port for nnodes > 1);
- puts a small guardian (ddp_lab._reaper) between the kernel and torchrun that
  kills the whole tree on timeout, on interrupt and when the kernel dies;
- raises LaunchError carrying the failing rank's own exception, not torchrun's
  ChildFailedError banner (that stays in `LaunchError.run.log`);
- sets OMP_NUM_THREADS to cores // processes (torchrun alone would force 1 and
  print a warning banner); pass `threads=` to choose.
"""
from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
RECORDS_ENV = "DDP_LAB_RECORDS"  # same name as ddp_lab.runtime.RECORDS_ENV (no torch import here)

_RANK_PREFIX = re.compile(r"^\[(\d+)\]:(.*)$")  # torchrun --log-line-prefix-template "[${rank}]:"
_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_TORCH_RANK_TAG = re.compile(r"^\[rank\d+\]: ?")  # torch tags uncaught exceptions itself
# A rank that died *because another rank died* reports a broken connection or a
# timed-out collective; the rank that really failed is the one that did not.
_SECONDARY = re.compile(r"Connection (reset|closed)|DistBackendError|DistNetworkError|"
                        r"Broken pipe|timed out|Timeout|NCCL communicator|pair\.cc|"
                        r"SignalException|ProcessGroup.*(abort|shut)", re.I)


class LaunchError(RuntimeError):
    """A launch failed; the message is the root cause, `.run` has the full log."""

    def __init__(self, message: str, run: "Run | None" = None, rank: int | None = None):
        super().__init__(message)
        self.run = run
        self.rank = rank


@dataclass
class Run:
    returncode: int
    wall_s: float
    log: str
    records: list = field(default_factory=list)
    cmd: list = field(default_factory=list)
    rank_lines: dict = field(default_factory=dict)

    def select(self, **match) -> list:
        """Records whose fields equal every keyword, e.g. run.select(kind="step", rank=0)."""
        return [r for r in self.records if all(r.get(k) == v for k, v in match.items())]

    def __repr__(self) -> str:
        return (f"Run(returncode={self.returncode}, wall_s={self.wall_s:.1f}, "
                f"records={len(self.records)}, log_lines={self.log.count(chr(10))})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(name: str) -> str:
    """Absolute path of a program in the workbook's scripts/ folder."""
    return str(SCRIPTS / name)


def _program_argv(program) -> list[str]:
    if isinstance(program, os.PathLike):
        parts = [os.fspath(program)]
    else:
        parts = shlex.split(program) if isinstance(program, str) else [str(p) for p in program]
    if not parts:
        raise ValueError("program is empty: give a script path or '-m module'")
    if parts[0] == "-m":
        return parts
    path = Path(parts[0])
    if not path.exists() and (SCRIPTS / path.name).exists() and not path.is_absolute():
        path = SCRIPTS / path.name
    if not path.exists():
        raise FileNotFoundError(f"no such program: {parts[0]} (give a path, or '-m package.module')")
    return [str(path.resolve()), *parts[1:]]


def _node_cmd(program_argv, nproc, nnodes, node_rank, port, max_restarts, args) -> list[str]:
    if nnodes == 1:
        rdzv = ["--standalone"]
    else:  # static rendezvous, as on two real machines (see notebook 00)
        rdzv = ["--nnodes", str(nnodes), "--node_rank", str(node_rank),
                "--master_addr", "127.0.0.1", "--master_port", str(port)]
    return [sys.executable, "-m", "ddp_lab._reaper", str(os.getpid()), "--",
            sys.executable, "-m", "torch.distributed.run", *rdzv,
            "--nproc_per_node", str(nproc), "--max_restarts", str(max_restarts),
            "--tee", "3", "--log-line-prefix-template", "[${rank}]:", *program_argv, *map(str, args)]


def _reader(stream, node, q) -> None:
    for line in iter(stream.readline, ""):
        q.put((node, line.rstrip("\n")))
    q.put((node, None))


def _kill_all(procs, grace: float = 5.0) -> None:
    """Ask each guardian to kill its tree, then make sure nothing below us survives."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    # Backstop: anything still below the guardians (they may have been killed first).
    for p in procs:
        try:
            kids = psutil.Process(p.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        for k in kids:
            try:
                k.kill()
            except psutil.Error:
                pass
        if p.poll() is None:
            p.kill()
        p.wait()


def torchrun(program, nproc: int = 2, args=(), nnodes: int = 1, max_restarts: int = 0,
             timeout: float = 300, env: dict | None = None, threads: int | None = None,
             stream: bool = True) -> Run:
    """Run `program` on nproc processes per node (nnodes simulated nodes on localhost).

    program: a script path (relative paths also resolve in scripts/) or "-m module".
    Returns a Run; raises LaunchError on failure or timeout. KeyboardInterrupt
    (the notebook's stop button) kills every process and is re-raised.
    """
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"nproc and nnodes must be at least 1 (got nproc={nproc}, nnodes={nnodes})")
    program_argv = _program_argv(program)
    records_dir = tempfile.mkdtemp(prefix="ddp_lab_records_")
    world = nproc * nnodes
    child_env = {**os.environ, **(env or {})}
    child_env[RECORDS_ENV] = records_dir
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env.setdefault("OMP_NUM_THREADS", str(threads or max(1, (os.cpu_count() or 1) // world)))
    if threads:
        child_env["OMP_NUM_THREADS"] = str(threads)
    if max_restarts > 0:
        # Restarted workers get a store of their own instead of reusing the dead attempt's
        # (pytorch/pytorch#167288: stale peer addresses -> gloo "Connection refused").
        child_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Keep children importing this checkout's ddp_lab even from a notebook folder.
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), child_env.get("PYTHONPATH")]))
    port = free_port()
    cmds = [_node_cmd(program_argv, nproc, nnodes, i, port, max_restarts, args) for i in range(nnodes)]

    q: queue.Queue = queue.Queue()
    procs, lines, rank_lines = [], [], {}
    start = time.time()
    try:
        for node, cmd in enumerate(cmds):
            p = subprocess.Popen(cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1)
            procs.append(p)
            threading.Thread(target=_reader, args=(p.stdout, node, q), daemon=True).start()
        open_streams = len(procs)
        while open_streams:
            if time.time() - start > timeout:
                _kill_all(procs)
                run = _finish(procs, start, lines, rank_lines, records_dir, cmds)
                raise LaunchError(_timeout_message(timeout, rank_lines), run)
            try:
                node, line = q.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                open_streams -= 1
                continue
            lines.append(line)
            m = _RANK_PREFIX.match(line)
            if m:
                rank = int(m.group(1))
                text = _TORCH_RANK_TAG.sub("", m.group(2))
                rank_lines.setdefault(rank, []).append(text)
                if stream:
                    print(f"[rank {rank}] {text}", flush=True)
        for p in procs:
            p.wait()
    except KeyboardInterrupt:
        _kill_all(procs)
        shutil.rmtree(records_dir, ignore_errors=True)
        print("[launch] interrupted: every process of this launch was stopped", flush=True)
        raise
    run = _finish(procs, start, lines, rank_lines, records_dir, cmds)
    if run.returncode != 0:
        message, rank = root_cause(run.log, rank_lines)
        raise LaunchError(message, run, rank)
    return run


def _finish(procs, start, lines, rank_lines, records_dir, cmds) -> Run:
    codes = [p.returncode if p.returncode is not None else -9 for p in procs]
    records = read_records(records_dir)
    shutil.rmtree(records_dir, ignore_errors=True)
    return Run(returncode=next((c for c in codes if c != 0), 0), wall_s=time.time() - start,
               log="\n".join(lines) + "\n", records=records, cmd=cmds, rank_lines=rank_lines)


def read_records(folder) -> list:
    """Merge rank*.jsonl files (rank order, then write order); skip a torn last line."""
    out = []
    files = sorted(Path(folder).glob("rank*.jsonl"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    for path in files:
        rank = int(re.sub(r"\D", "", path.stem) or 0)
        for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError:
                continue
            rec.setdefault("rank", rank)
            out.append(rec)
    return out


def _timeout_message(timeout, rank_lines) -> str:
    last = "; ".join(f"rank {r}: {ls[-1].strip()[:80]!r}" for r, ls in sorted(rank_lines.items()) if ls)
    return (f"timed out after {timeout:g} s; every process of this launch was killed. "
            f"A rank waiting forever in a collective usually means the ranks disagree on how many "
            f"collectives to run (uneven batches?). Last output: {last or 'none'}")


def root_cause(log: str, rank_lines: dict) -> tuple[str, int | None]:
    """The failing rank's own exception, found in torchrun's 'Root Cause' block and that rank's output."""
    rank, exitcode = None, None
    tail = log.split("Root Cause (first observed failure):", 1)
    if len(tail) == 2:
        for line in tail[1].splitlines():
            m = _ROOT_CAUSE_RANK.match(line)
            if m and rank is None:
                rank = int(m.group(1))
            m = _EXITCODE.match(line)
            if m and exitcode is None:
                exitcode = int(m.group(1))
    found = {r: tb for r in sorted(rank_lines) if (tb := _last_traceback(rank_lines[r]))}
    primary = [r for r, (exc, _) in found.items() if not _SECONDARY.search(exc)]
    order = primary + ([rank] if rank in found else []) + sorted(found)
    if order:
        r = order[0]
        exc_line, text = found[r]
        return f"rank {r} failed: {exc_line}\n\n{text}", r
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"rank {rank} was killed by {name} (exit code {exitcode})", rank
    # No traceback: a program that exits with a message of its own (e.g. "error: ..." on
    # rank 0 only, as scripts/train_ddp.py does for bad input) says it on its last line.
    said = []
    for r, ls in sorted(rank_lines.items()):
        nonblank = [l.strip() for l in ls if l.strip()]
        if nonblank:
            said.append((r, nonblank[-1]))
    said.sort(key=lambda rl: (not rl[1].lower().startswith("error"), rl[0] != rank))
    if said:
        r, last = said[0]
        return f"rank {r} exited with code {exitcode}: {last}", r
    if rank is not None:
        return f"rank {rank} exited with code {exitcode}", rank
    last = "\n".join(log.strip().splitlines()[-15:])
    return f"launch failed; last lines of the log:\n{last}", None


def _last_traceback(lines: list[str]):
    starts = [i for i, l in enumerate(lines) if l.strip() == "Traceback (most recent call last):"]
    if not starts:
        return None
    # Chained exceptions print several tracebacks; the last block's last line is what was raised.
    block = lines[starts[-1]:]
    exc_i = next((i for i, l in enumerate(block[1:], 1) if l and not l.startswith(" ")), None)
    if exc_i is None:
        return None
    exc_line = block[exc_i].strip()
    first = starts[0]
    text = "\n".join(l for l in lines[first:starts[-1] + exc_i + 1])
    return exc_line, text
