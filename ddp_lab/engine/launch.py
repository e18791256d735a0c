"""Start a real multi-process job from a notebook cell, safely.

    from ddp_lab.engine import launch
    run = launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=2)
    run.records          # JSON lines the ranks wrote, each with a "rank" field

Why not `!torchrun prog.py` in a cell? A failing `!` command does not fail the
cell, `torchrun` may not be on PATH (or may belong to another Python), the
cell's interrupt button does not reach the workers, and a kernel restart
leaves them running. This module instead:

- runs `sys.executable -m torch.distributed.run` (the kernel's own Python);
- streams every rank's output live as `[rank N] ...`, in batches (a kernel that
  is slow to accept output never slows or times out the job), showing at most
  SHOW_HEAD + SHOW_TAIL lines; every line stays in `Run.log`;
- gives each launch its own port (`--standalone`, or a free port for nnodes > 1);
- gives each simulated node GPUs of its own, or none where there are too few (node_gpus);
- runs a local job in a private network namespace (ddp_lab.engine.private): what its ranks and
  torchrun's rendezvous store listen on is reachable over loopback only, not from the network;
  network=True (or a `--download` among the args) keeps the machine's network, DDP_LAB_PRIVATE=off
  turns it off everywhere;
- with link="100mbit", puts each node in a network namespace of its own, joined to the others
  by a link shaped to that rate (ddp_lab.engine.netcluster);
- puts a small guardian (ddp_lab.engine._reaper) between the kernel and torchrun that
  kills the whole tree on timeout, on interrupt and when the kernel dies;
- leaves no folder behind: the ranks' records and torchrun's own per-rank log files (its
  torchelastic_* folder) live in one folder of the launch, removed when it ends, however it ends.
  Kept only what you ask for: torchrun's logs in PET_LOG_DIR (torchrun's --log-dir) when you set
  it, e.g. env={"PET_LOG_DIR": "logs"}; the autopsy's folder when it explains a hang (its message
  names it). Every line of output is in Run.log anyway;
- raises LaunchError naming the rank that failed first and why (ddp_lab.engine._rootcause),
  not torchrun's ChildFailedError banner (that stays in `LaunchError.run.log`);
- sets OMP_NUM_THREADS to cores // processes (torchrun alone would force 1 and
  print a warning banner); pass `threads=` to choose;
- explains a hang before it kills (ddp_lab.autopsy): on timeout, and when a rank fails while
  others wait, every rank's Python stack and Flight Recorder entries are collected (armed
  through the environment, the program unchanged) and LaunchError's message starts with a
  diagnosis such as "rank 0 waits in all_reduce #12 (train.py:57); rank 1 never reached
  collective #12; its stack: train.py:71 in evaluate". `LaunchError.autopsy` holds it
  structured; the full per-rank detail stays in its folder. DDP_LAB_AUTOPSY=0 turns it off.
"""
from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ddp_lab.engine import netcluster, private
from ddp_lab.engine._rootcause import root_cause
from ddp_lab.autopsy import collect as _autopsy

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
RECORDS_ENV = "DDP_LAB_RECORDS"  # same name as ddp_lab.engine.runtime.RECORDS_ENV (no torch import here)

# What a launch shows live: the first SHOW_HEAD lines, then the last SHOW_TAIL at the end.
# A Jupyter kernel takes a few thousand flushed writes a second; a program printing 100k
# lines would otherwise spend minutes in the display. Every line stays in Run.log.
SHOW_HEAD, SHOW_TAIL = 1000, 1000
FLUSH_EVERY_S, FLUSH_LINES = 0.1, 200  # one write per batch, not one per line

_TORCH_RANK_TAG = re.compile(r"^\[rank\d+\]: ?")  # torch tags uncaught exceptions itself


class LaunchInterrupted(KeyboardInterrupt):
    """The stop button during a launch. Still a KeyboardInterrupt (the cell stops, `Run All`
    stops), but a notebook shows it as one line instead of a traceback through the launcher's
    queue and threading internals, which looks like a crash."""

    def __init__(self, message: str = "", run: "Run | None" = None):
        super().__init__(message)
        self.run = run  # the finished job's Run when the stop came after it had ended, else None

    def _render_traceback_(self):  # IPython renders this instead of the traceback
        return [f"LaunchInterrupted: {self}"]


class ClusterUnavailable(RuntimeError):
    """link= was asked for where the localhost cluster cannot be built; the message says why and
    what would make it work (netcluster.available())."""


class LaunchError(RuntimeError):
    """A launch failed; the message is the root cause, `.run` has the full log."""

    def __init__(self, message: str, run: "Run | None" = None, rank: int | None = None,
                 autopsy=None):
        super().__init__(message)
        self.run = run
        self.rank = rank
        self.autopsy = autopsy  # a ddp_lab.autopsy.diagnose.Diagnosis when the hang was explained


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
    # Only a bare name may mean the workbook's own script: "myproj/train_ddp.py" that does
    # not exist must not quietly run scripts/train_ddp.py instead.
    bare = not any(sep in parts[0] for sep in filter(None, (os.sep, os.altsep)))
    if not path.exists() and bare and (SCRIPTS / path.name).exists():
        path = SCRIPTS / path.name
    if not path.exists():
        where = f" nor in {SCRIPTS}" if bare else ""
        raise FileNotFoundError(
            f"no such program: {parts[0]} (not in {Path.cwd()}{where}; give a path that exists, "
            f"a name from the workbook's scripts/, or '-m package.module')")
    return [str(path.resolve()), *parts[1:]]


def node_gpus(nnodes: int, nproc: int, env: dict) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each simulated node (None: leave it as it is).

    Simulated nodes share this machine, and each numbers its ranks' GPUs from LOCAL_RANK 0: two
    nodes would both take GPU 0, and NCCL refuses two ranks on one GPU. So each node sees GPUs of
    its own, as on separate machines, where there are enough for every rank; otherwise none, and
    the ranks run on the CPU over gloo, as the scripts and the engine choose without a GPU."""
    if nnodes == 1:
        return [None]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        pool = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        import torch  # only here: a single-node launch need not import it
        pool = [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if len(pool) < nnodes * nproc:
        return [""] * nnodes
    return [",".join(pool[i * nproc:(i + 1) * nproc]) for i in range(nnodes)]


def _guardian(cleanup=()) -> list[str]:
    """The guardian's command line (ddp_lab.engine._reaper); it removes the folders of `cleanup`
    when the kernel dies, which would have removed them itself."""
    rm = [arg for folder in cleanup for arg in ("--rm", str(folder))]
    return [sys.executable, "-m", "ddp_lab.engine._reaper", str(os.getpid()), *rm, "--"]


def _node_cmd(program_argv, nproc, nnodes, node_rank, port, max_restarts, args,
              master: str = "127.0.0.1", guardian: bool = True, cleanup=()) -> list[str]:
    if nnodes == 1:
        rdzv = ["--standalone"]
    else:  # static rendezvous, as on two real machines (see notebook 00)
        rdzv = ["--nnodes", str(nnodes), "--node_rank", str(node_rank),
                "--master_addr", master, "--master_port", str(port)]
    guard = _guardian(cleanup) if guardian else []
    return [*guard, sys.executable, "-m", "torch.distributed.run", *rdzv,
            "--nproc_per_node", str(nproc), "--max_restarts", str(max_restarts),
            "--tee", "3", *program_argv, *map(str, args)]


def _reader(stream, key, q, ended) -> None:
    with stream:  # closed at its end: no open pipe left for the garbage collector to warn about
        for line in iter(stream.readline, ""):
            q.put((key, line.rstrip("\n")))
    ended[key] = time.time()  # the job's own end, however long the display takes after it
    q.put((key, None))


class _Output:
    """Splits torchrun's output into ranks' lines, keeps all of them, shows a bounded part.

    torchrun tails each worker's stdout and stderr files and writes `PREFIX + what it read`.
    What it read need not end in a newline: an input() prompt, a tqdm bar after its "\\r",
    or half of a print() (the text and its newline are two writes). Such a piece runs into
    whatever torchrun writes next, often another rank's piece. So the prefix carries a
    per-launch token, found anywhere in a line and never mistaken for a worker's text or for
    torchrun's own "[0]:" banner lines, and a piece without its newline is held per
    (pipe, rank) until the rest of its line arrives.
    """

    def __init__(self, stream: bool, hide=()):
        self.hide = tuple(hide)  # a rank's line holding one of these stays in the log only
        self.token = f"ddp-lab-{secrets.token_hex(4)}"
        self.prefix = f"<{self.token}:${{rank}}>"  # torchrun fills in ${rank}
        self.split = re.compile(rf"<{self.token}:(\d+)>").split
        self.lines: list[str] = []
        self.rank_lines: dict[int, list[str]] = {}  # stdout and stderr, as they came
        self.rank_errors: dict[int, list[str]] = {}  # stderr only: tracebacks, never cut by a print
        self.held: dict[tuple, str] = {}
        self.out = sys.stdout if stream else None
        self.pending: list[str] = []
        self.shown, self.hidden, self.last_flush = 0, 0, time.monotonic()
        self.tail: deque = deque(maxlen=SHOW_TAIL)

    def feed(self, line: str, pipe: tuple) -> None:
        parts = self.split(line)
        if parts[0] or len(parts) == 1:  # torchrun's own output: kept in the log, not shown
            self.lines.append(parts[0])
        pieces = list(zip(parts[1::2], parts[2::2]))
        for i, (rank, text) in enumerate(pieces):
            key = (pipe, int(rank))
            if i < len(pieces) - 1:  # another piece follows before the newline: this one has none
                self.held[key] = self.held.get(key, "") + text
            else:
                self._rank_line(key, self.held.pop(key, "") + text)

    def end(self, pipe: tuple) -> None:
        """The pipe closed: what is still held will get no newline."""
        for key in [k for k in self.held if k[0] == pipe]:
            self._rank_line(key, self.held.pop(key))

    def _rank_line(self, key: tuple, text: str) -> None:
        (_, stream), rank = key
        self.lines.append(f"[{rank}]:{text}")
        if any(h in text for h in self.hide):
            return
        text = _TORCH_RANK_TAG.sub("", text)
        self.rank_lines.setdefault(rank, []).append(text)
        if stream == "err":
            self.rank_errors.setdefault(rank, []).append(text)
        if self.out is not None and text.strip():  # "\r" of a progress bar leaves empty lines
            self._show(f"[rank {rank}] {text}")

    def _show(self, line: str) -> None:
        if self.shown + len(self.pending) < SHOW_HEAD:
            self.pending.append(line)
            if self.shown + len(self.pending) == SHOW_HEAD:
                self.pending.append(f"[launch] more than {SHOW_HEAD:,} lines: the last {SHOW_TAIL:,} "
                                    f"are shown when the job ends; the full log is in run.log")
            return
        if len(self.tail) == self.tail.maxlen:
            self.hidden += 1
        self.tail.append(line)

    def flush(self, force: bool = False) -> None:
        """Write what is pending as one batch when it is big or old enough (or forced)."""
        if not self.pending or not (force or len(self.pending) >= FLUSH_LINES
                                    or time.monotonic() - self.last_flush >= FLUSH_EVERY_S):
            return
        batch, self.pending = self.pending, []
        self.shown += len(batch)
        self.out.write("\n".join(batch) + "\n")
        self.out.flush()
        self.last_flush = time.monotonic()

    def close(self) -> None:
        for key in list(self.held):
            self._rank_line(key, self.held.pop(key))
        if self.out is None:
            return
        if self.hidden:
            self.pending.append(f"... {self.hidden:,} lines not shown; the full log is in run.log")
        self.pending.extend(self.tail)
        self.tail.clear()
        self.flush(force=True)


def _all_ended(procs, ended, grace: float = 2.0) -> bool:
    """Every process closed its output and exited (waiting up to `grace` s for the exits)."""
    if not procs or len(ended) < 2 * len(procs):
        return False
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


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


def _script_cmds(node_script, program_argv, nproc, nnodes, port, max_restarts, args):
    """Each node's command and environment when a launch file of scripts/ starts the node, as an
    operator would on a real machine (launch_multinode.sh: its variables, then train_ddp.py's args)."""
    if node_script != "launch_multinode.sh":
        raise ValueError(f"node_script={node_script!r}: the launch file that starts each node is "
                         "'launch_multinode.sh' (scripts/); slurm_ddp.sbatch needs SLURM (elastic.rehearse)")
    if Path(program_argv[0]).name != "train_ddp.py" or len(program_argv) > 1:
        raise ValueError("launch_multinode.sh starts scripts/train_ddp.py: give program='train_ddp.py' "
                         "and its options in args")
    cmds = [["bash", str(SCRIPTS / node_script), *map(str, args)] for _ in range(nnodes)]
    envs = [{"NNODES": str(nnodes), "NODE_RANK": str(i), "NPROC_PER_NODE": str(nproc),
             "MASTER_ADDR": netcluster.node_addr(0), "MASTER_PORT": str(port), "PYTHON": sys.executable,
             # torchrun reads any of its options from PET_<OPTION>: the rank prefix needs --tee
             "PET_TEE": "3", "PET_MAX_RESTARTS": str(max_restarts)} for i in range(nnodes)]
    return cmds, envs


def _require_cluster(link: str) -> None:
    """A ValueError naming the fix on a bad rate; ClusterUnavailable (one line: why) where the
    machine cannot build the localhost cluster."""
    netcluster.rate_bits(link)
    ok, why = netcluster.available()
    if not ok:
        raise ClusterUnavailable(why)


def _importing_this_checkout(env: dict) -> dict:
    """Children import this checkout's ddp_lab, even started from a notebook folder."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _cluster_cmd(cmds, link, envs=None, cleanup=()) -> list[str]:
    """One guardian over the localhost cluster (ddp_lab.engine.netcluster), which runs each
    node's command in its own network namespace, joined to the others by a link of `link`.
    Its ranks see no GPU: NCCL between GPUs of one machine would see one host and bypass the
    link (shared memory, NVLink), so the cluster runs on the CPU over gloo, with GPUs or not.
    cmds=None: nodes are started and lost on request (netcluster.serve, elastic.Cluster)."""
    cluster = [*_guardian(cleanup), *netcluster.UNSHARE,
               sys.executable, "-m", "ddp_lab.engine.netcluster", "--link", link]
    if cmds is None:
        return [*cluster, "--serve"]
    envs = [{**(e or {}), "CUDA_VISIBLE_DEVICES": ""} for e in (envs or [None] * len(cmds))]
    return [*cluster, "--commands", json.dumps(cmds), "--envs", json.dumps(envs)]


def on_nodes(commands, link: str, timeout: float = 180, check: bool = True) -> list[str]:
    """Run one command per node of the localhost cluster, each in its node's network namespace,
    the nodes joined by a link of `link`: e.g. the doctor on every node at once. commands: one argv
    per node. Returns what each node printed (stdout). LaunchError when the time runs out, or, with
    check, when a node exits non-zero; either way nothing of it is left running."""
    if len(commands) < 2:
        raise ValueError(f"on_nodes runs one command per node: give 2 or more (got {len(commands)})")
    _require_cluster(link)
    folder = Path(tempfile.mkdtemp(prefix="ddp_lab_nodes_"))
    outs = [folder / f"node{k}.out" for k in range(len(commands))]
    wrapped = [["sh", "-c", 'out="$1"; shift; exec "$@" > "$out"', "sh", str(o), *map(str, c)]
               for o, c in zip(outs, commands)]
    p = subprocess.Popen(_cluster_cmd(wrapped, link, cleanup=[folder]), env=_importing_this_checkout(dict(os.environ)),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                         errors="replace")
    try:
        _, err = p.communicate(timeout=timeout)
        printed = [o.read_text(errors="replace") if o.exists() else "" for o in outs]
    except subprocess.TimeoutExpired:
        _kill_all([p])
        raise LaunchError(f"timed out after {timeout:g} s; every process on the nodes was killed") from None
    except KeyboardInterrupt:
        _kill_all([p])
        raise LaunchInterrupted("stopped, and every process on the nodes with it") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if p.returncode and check:
        last = (err.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        raise LaunchError(f"a node failed (exit status {p.returncode}): {last}")
    return printed


def torchrun(program, nproc: int = 2, args=(), nnodes: int = 1, max_restarts: int = 0,
             timeout: float = 300, env: dict | None = None, threads: int | None = None,
             stream: bool = True, link: str | None = None, node_script: str | None = None,
             network: bool = False) -> Run:
    """Run `program` on nproc processes per node (nnodes simulated nodes on localhost; on a
    machine with GPUs, see node_gpus).

    link: with nnodes > 1, put each node in a network namespace of its own, joined to the others
    by a link of this rate ("100mbit", "1gbit", "unshaped"): ddp_lab.engine.netcluster. Where
    the machine cannot, ClusterUnavailable says why in one line.
    node_script: with link, start each node with this launch file of scripts/ instead of a
    torchrun line: "launch_multinode.sh" (program "train_ddp.py"), run once per node namespace.

    network: keep the machine's network for this job (a dataset download, a master elsewhere);
    otherwise a local job runs in a private network namespace, loopback only (ddp_lab.engine.private).
    A `--download` in the program's arguments implies it.

    program: a script path, a bare name from the workbook's scripts/ ("train_ddp.py"),
    or "-m module". Returns a Run; raises LaunchError on failure or timeout (the job's
    own time: a slow display does not count). KeyboardInterrupt (the notebook's stop
    button) kills every process and is re-raised.
    """
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"nproc and nnodes must be at least 1 (got nproc={nproc}, nnodes={nnodes})")
    if node_script is not None and link is None:
        raise ValueError(f"node_script={node_script!r} starts the nodes of the localhost cluster: give link= too")
    if link is not None:
        if nnodes < 2:
            raise ValueError(f"link={link!r} joins nodes: give nnodes=2 or more (got nnodes={nnodes})")
        _require_cluster(link)
    program_argv = _program_argv(program)
    if node_script is not None:  # a wrong launch file or program: the ValueError before anything starts
        _script_cmds(node_script, program_argv, nproc, nnodes, 0, max_restarts, args)
    # The launch's folder: the ranks' records, and torchrun's own log files, which it would
    # otherwise leave in a torchelastic_* folder of the temp dir after every launch. Removed when
    # the launch ends, also when the kernel dies (by the guardian); PET_LOG_DIR keeps torchrun's.
    records_dir = tempfile.mkdtemp(prefix="ddp_lab_launch_")
    world = nproc * nnodes
    child_env = {**os.environ, **(env or {})}
    child_env[RECORDS_ENV] = records_dir
    child_env.setdefault("PET_LOG_DIR", os.path.join(records_dir, "torchelastic"))  # torchrun's --log-dir
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env.setdefault("OMP_NUM_THREADS", str(threads or max(1, (os.cpu_count() or 1) // world)))
    if threads:
        child_env["OMP_NUM_THREADS"] = str(threads)
    if max_restarts > 0:
        # Restarted workers get a store of their own instead of reusing the dead attempt's
        # (pytorch/pytorch#167288: stale peer addresses -> gloo "Connection refused").
        child_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    child_env = _importing_this_checkout(child_env)
    if link is None:
        network = network or _needs_network(program_argv, args, stream)
    quiet = link is None and not network and private.available()
    if quiet:  # in a private namespace: loopback for gloo; torch's warnings about its lack of DNS unshown
        child_env = {**private.LOOPBACK_ENV, **child_env}
    autopsy = _autopsy.start(child_env)  # arms the ranks through child_env; None when off
    port = free_port()
    output = _Output(stream, hide=private.NO_DNS_WARNINGS if quiet else ())
    # The prefix by environment: torchrun has read it there since torch 2.2, the
    # --log-line-prefix-template flag only in releases after 2.11.
    child_env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = output.prefix
    master = netcluster.node_addr(0) if link else "127.0.0.1"
    cleanup = [records_dir, *([autopsy.folder] if autopsy is not None else [])]
    cmds = [_node_cmd(program_argv, nproc, nnodes, i, port, max_restarts, args, master, guardian=not link,
                      cleanup=cleanup) for i in range(nnodes)]
    if link and node_script:  # as an operator would: the launch file, once on each node
        cmds, envs = _script_cmds(node_script, program_argv, nproc, nnodes, port, max_restarts, args)
        spawn = [(_cluster_cmd(cmds, link, envs, cleanup), None)]
    elif link:  # one process starts every node, each in its namespace
        spawn = [(_cluster_cmd(cmds, link, cleanup=cleanup), None)]
    else:
        spawn = list(zip(cmds, node_gpus(nnodes, nproc, child_env)))

    # Reader threads drain the pipes into a queue, so the job never waits for this thread,
    # which may be slow to display (a busy kernel). The timeout and wall_s are the job's:
    # `ended` holds when each pipe closed, i.e. when the processes writing it were gone.
    # stdout and stderr stay apart so that a rank's traceback is never cut by its prints.
    q: queue.Queue = queue.Queue()
    procs, ended = [], {}
    start = time.time()
    started = time.monotonic()  # the timeout's clock: a wall-clock step must not end a job early
    shared = None  # several local nodes share one private namespace (they meet on its loopback)
    try:
        if not link:
            shared = private.Shared(network) if nnodes > 1 else None
            spawn = [(shared.enter(c) if shared else private.wrap(c, network), v) for c, v in spawn]
        for node, (cmd, visible) in enumerate(spawn):
            env = child_env if visible is None else {**child_env, "CUDA_VISIBLE_DEVICES": visible}
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1)
            procs.append(p)
            for key, pipe in (((node, "out"), p.stdout), ((node, "err"), p.stderr)):
                threading.Thread(target=_reader, args=(pipe, key, q, ended), daemon=True).start()
        open_streams = n_streams = 2 * len(procs)
        while open_streams:
            if len(ended) < n_streams and time.monotonic() - started > timeout:
                if autopsy is not None:  # before the kill: ask the live ranks where they are
                    autopsy.collect([p.pid for p in procs])
                _kill_all(procs)
                output.close()
                run = _finish(procs, start, output, records_dir, cmds, ended)
                message = _timeout_message(timeout, output.rank_lines)
                diagnosis = _diagnose(autopsy, world)
                if diagnosis is not None and diagnosis.kind == "no_collective":
                    message = f"{message}\n{diagnosis.message()}"  # not a collective hang: add where
                elif diagnosis is not None:
                    message = (f"timed out after {timeout:g} s; every process of this launch was killed.\n"
                               f"{diagnosis.message()}")
                raise LaunchError(message, run, autopsy=diagnosis)
            try:
                key, line = q.get(timeout=FLUSH_EVERY_S / 2)
            except queue.Empty:
                pass
            else:
                if line is None:
                    open_streams -= 1
                    output.end(key)
                else:
                    output.feed(line, key)
            output.flush()
        output.close()
        for p in procs:
            p.wait()
    except KeyboardInterrupt:
        finished = _all_ended(procs, ended)  # asked before the kill: had the job already ended?
        _kill_all(procs)
        if autopsy is not None:
            autopsy.discard()
        output.close()
        if finished:  # the stop came too late to stop anything: keep what the job produced
            run = _finish(procs, start, output, records_dir, cmds, ended)
            raise LaunchInterrupted(
                f"the job had already finished (exit status {run.returncode}) when the stop came: nothing "
                f"was stopped, and its result stands (LaunchInterrupted.run; run the cell again for a fresh "
                f"launch)", run) from None
        shutil.rmtree(records_dir, ignore_errors=True)
        raise LaunchInterrupted("the launch was stopped, and every process it started with it") from None
    except BaseException:  # a timeout (its records already read), or the launch could not start
        _kill_all(procs)
        shutil.rmtree(records_dir, ignore_errors=True)
        raise
    finally:
        if shared is not None:
            shared.close()
    run = _finish(procs, start, output, records_dir, cmds, ended)
    if run.returncode != 0:
        tier = {}
        message, rank = root_cause(run.log, run.rank_lines, output.rank_errors, tier)
        if private.no_network_hint(run.log):  # it reached for the network and found none: say what to do
            hint = private.NO_NETWORK_HINT if quiet else private.CLUSTER_HINT if link else private.OFFLINE_HINT
            message = f"{message}\n{hint}"
        diagnosis = _diagnose(autopsy, world)
        if diagnosis is not None and diagnosis.kind in ("mismatch", "missing"):
            if tier.get("tier") in ("secondary", "abort", "none"):  # a hang, told as its consequences:
                first = message.split("\n\n")[0]                # their first paragraph; the rest in run.log
                message = (f"{diagnosis.message()}\n\n{first}\n(a consequence of the hang above; every "
                           f"rank's whole output is in LaunchError.run.log)")
            else:  # a rank's own error comes first; the autopsy says what the others were doing
                message = f"{message}\n\nThe other ranks at that moment: {diagnosis.message()}"
        raise LaunchError(message, run, rank, autopsy=diagnosis)
    if autopsy is not None:
        autopsy.discard()
    return run


def _needs_network(program_argv, args, stream: bool) -> bool:
    """A program asked to --download needs the network: it keeps the machine's (one line says so)."""
    if "--download" not in [*program_argv, *map(str, args)]:
        return False
    if stream and private.available():
        print("[launch] --download: this job keeps the machine's network (no private namespace) "
              "to fetch the dataset", flush=True)
    return True


def _diagnose(autopsy, world: int):
    """The autopsy's diagnosis, or None (then the message is what it was without one)."""
    if autopsy is None:
        return None
    diagnosis = autopsy.diagnosis(world)
    if diagnosis is None:
        autopsy.discard()
    return diagnosis


def _finish(procs, start, output, records_dir, cmds, ended) -> Run:
    codes = [p.returncode if p.returncode is not None else -9 for p in procs]
    records = read_records(records_dir)
    shutil.rmtree(records_dir, ignore_errors=True)
    end = max(ended.values()) if len(ended) == 2 * len(procs) else time.time()
    return Run(returncode=next((c for c in codes if c != 0), 0), wall_s=end - start,
               log="\n".join(output.lines) + "\n", records=records, cmd=cmds,
               rank_lines=output.rank_lines)


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
    said = {r: [l.strip() for l in ls if l.strip()] for r, ls in sorted(rank_lines.items())}
    last = "; ".join(f"rank {r}: {ls[-1][:80]!r}" for r, ls in said.items() if ls)
    return (f"timed out after {timeout:g} s; every process of this launch was killed. "
            f"A rank waiting forever in a collective usually means the ranks disagree on how many "
            f"collectives to run (uneven batches?). Last output: {last or 'none'}")

