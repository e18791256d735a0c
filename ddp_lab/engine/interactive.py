"""Persistent ranks you can talk to from a notebook: one DDP process group, cell by cell.

    from ddp_lab.engine import interactive
    ranks = interactive.start(nproc=2)     # N ipyparallel engines, joined into one process group
    %%px                                   # a cell that runs on every rank (rank, world_size,
    print(rank, dist.get_world_size())     # device, torch and dist are already defined there)
    ranks.gather("model.weight.grad")      # one value per rank, back in the kernel, rank order
    ranks.collective("all_reduce", "t")    # run a collective on a tensor every rank holds
    ranks.side_by_side("x.sum()", "x")     # a table: one row per expression, one column per rank
    ranks.stop()                           # every engine process ends

A launch (ddp_lab.engine.launch) runs a program to the end; these ranks stay up between cells,
so you can stop in the middle of a DDP step and ask rank 1 what its gradient is.
The engines join a gloo process group on CPU (NCCL, one GPU each, when every rank has
one), with a timeout, so a collective that only some ranks call fails instead of hanging.
Everything they listen on is loopback: the controller, rank 0's store, and gloo's (and NCCL's)
connections between ranks (loopback_env), whatever address the machine's hostname resolves to.

Process hygiene is the launcher's: `ipcluster` runs under the same guardian
(ddp_lab.engine._reaper), which kills the whole tree on stop(), when the kernel is restarted
or killed, and when the cluster fails. The stop button interrupts what the ranks are
running (they stay up, idle); an interrupt while they start stops them all.
A %%px cell (ddp_lab.engine._pxmagic) streams what each rank prints, shows a rank's error once, short,
and keeps the lines a rank printed just before the cell ended or was stopped.
"""
from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddp_lab.engine.launch import ROOT, _kill_all, free_port

START_TIMEOUT_S = 180   # a loaded 2-core machine took 20 s for two ranks; a dead one never ends
RANKS_ENV = "DDP_LAB_RANKS"  # environment variable: the cluster id, in every engine's environment
GROUP_TIMEOUT_S = 60    # a collective some ranks never join fails after this long
OUTPUT_WAIT_S = 30      # printed lines travel apart from the reply; a loaded machine needs < 1 s


class RanksError(RuntimeError):
    """The ranks could not start, or code failed on a rank; the message says which and why.
    errors: (rank, "ValueError: ...") for each rank whose code raised."""

    def __init__(self, message: str, errors=()):
        super().__init__(message)
        self.errors = list(errors)


class RanksInterrupted(KeyboardInterrupt):
    """The stop button while the ranks run a cell. Still a KeyboardInterrupt (the cell and `Run All`
    stop), shown as one line, as a stopped launch is, not as a traceback through ipyparallel."""

    def _render_traceback_(self):  # IPython renders this instead of the traceback
        return [f"RanksInterrupted: {self}"]


class Table:
    """Values side by side: one row per label, one column per rank (HTML in JupyterLab)."""

    def __init__(self, rows: dict):
        self.rows = rows  # label -> [value on rank 0, value on rank 1, ...]

    def _repr_html_(self) -> str:
        from html import escape
        n = max((len(v) for v in self.rows.values()), default=0)
        head = "".join(f"<th>rank {r}</th>" for r in range(n))
        body = "".join(
            f"<tr><th style='text-align:left'><code>{escape(k)}</code></th>"
            + "".join(f"<td style='text-align:left'><pre>{escape(str(x))}</pre></td>" for x in v)
            + "</tr>" for k, v in self.rows.items())
        return f"<table><tr><th></th>{head}</tr>{body}</table>"

    def __repr__(self) -> str:
        lines = []
        for label, values in self.rows.items():
            cells = [str(v).splitlines() or [""] for v in values]
            width = max(len(f"rank {len(cells)}"), *(len(line) for c in cells for line in c))
            lines.append(label)
            lines.append("  " + " | ".join(f"rank {r}".ljust(width) for r in range(len(cells))))
            for i in range(max(len(c) for c in cells)):
                row = [(c[i] if i < len(c) else "").ljust(width) for c in cells]
                lines.append("  " + " | ".join(row).rstrip())
        return "\n".join(lines)


def _join_code(rank: int, world: int, port: int, backend: str, timeout: float) -> str:
    return f"""
import datetime, os, socket, torch, torch.distributed as dist
rank, world_size = {rank}, {world}
local_rank = {rank}  # every rank lives on this machine; on a cluster: int(os.environ["LOCAL_RANK"])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="{rank}",
                  WORLD_SIZE="{world}", LOCAL_RANK="{rank}")
wait = datetime.timedelta(seconds={timeout})
# Rank 0 serves the group's store. Left to open its own socket, the store listens on every
# interface of the machine; handed one bound to loopback, it is reachable from this machine only.
listen_fd = socket.create_server(("127.0.0.1", {port})).detach() if rank == 0 else None
store = dist.TCPStore("127.0.0.1", {port}, world_size, rank == 0, timeout=wait, master_listen_fd=listen_fd)
bound = {{}}
if "{backend}" == "nccl":
    device = torch.device("cuda", local_rank)  # the GPU by local rank, never by global rank
    torch.cuda.set_device(device)
    bound = {{"device_id": device}}            # NCCL binds it at once, and barrier() knows it
else:
    device = torch.device("cpu")
dist.init_process_group("{backend}", store=store, rank=rank, world_size=world_size, timeout=wait, **bound)
del bound, listen_fd
get_ipython().InteractiveTB.set_mode("Plain")  # a rank's error: each frame in two lines
"""


def loopback_env() -> dict:
    """What makes the ranks' own connections loopback-only, whatever the hostname resolves to.

    Left alone, gloo (and NCCL's bootstrap) listen on the address the machine's hostname resolves
    to, often one of the network. Every rank lives on this machine, so loopback always reaches the
    others: it is set even over a GLOO_SOCKET_IFNAME the kernel inherited for real multi-node jobs."""
    import psutil
    lo = next((name for name, addrs in psutil.net_if_addrs().items()
               if any(a.address == "127.0.0.1" for a in addrs)), "lo")  # lo on Linux, lo0 on macOS
    return {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


def _pick_backend(nproc: int, backend: str | None) -> str:
    """The launcher's rule (runtime.pick_backend): NCCL only with a GPU for every rank."""
    from ddp_lab.engine import runtime
    return backend or runtime.pick_backend(local_world_size=nproc)[0]


class Ranks:
    """N live engines in one process group. Build with start(); end with stop()."""

    def __init__(self, nproc: int, backend: str, guardian, client, profile_dir: str, cluster_id: str):
        self.nproc, self.backend = nproc, backend
        self.cluster_id, self.profile_dir = cluster_id, profile_dir
        self._guardian, self.client = guardian, client
        self.view = client[:] if client is not None else None
        self.startup_s = 0.0

    # --- running code -------------------------------------------------------------------
    def _wait(self, result, interrupt_ranks: bool = True):
        """Wait for an AsyncResult; the stop button interrupts the ranks' work, not the ranks."""
        import ipyparallel as ipp
        try:
            return result.get()
        except KeyboardInterrupt:
            if not interrupt_ranks:
                raise
            self.client.send_signal("SIGINT", targets=self.view.targets, block=True)
            try:
                result.get(timeout=10)
            except Exception:  # the interrupted code raised KeyboardInterrupt, as it should
                pass
            if result.ready():  # what a rank printed just before the stop is still on its way
                result.wait_for_output(OUTPUT_WAIT_S)
            message = "the ranks stopped what they were running and wait for the next cell"
            raise RanksInterrupted(message) from None  # its one line says it; no print beside it
        except ipp.error.CompositeError as e:
            errors = _rank_errors(e)
            raise RanksError("\n".join(f"rank {r}: {line}" for r, line in errors), errors) from None

    def run(self, code: str) -> Table:
        """Run `code` on every rank; returns what each rank printed, side by side."""
        self._check()
        result = self.view.execute(code, block=False)
        self._wait(result)
        # The result can arrive before the ranks' printed output, which travels on another
        # channel (IOPub): without this wait a rank's lines are sometimes still missing.
        result.wait_for_output(timeout=OUTPUT_WAIT_S)
        return Table({"printed": [s.rstrip("\n") for s in result.stdout]})

    def gather(self, expr: str) -> list:
        """The value of `expr` on every rank, in rank order (tensors come back as tensors)."""
        self._check()
        self._wait(self.view.execute(f"_ddp_lab_value = ({expr})", block=False))
        values = self._wait(self.view.pull("_ddp_lab_value", block=False))
        self.view.execute("del _ddp_lab_value", block=True)
        return list(values)

    def collective(self, op: str, name: str, **kwargs) -> list:
        """Every rank calls torch.distributed.<op>(name, **kwargs); returns `name` from each rank.

        ranks.collective("all_reduce", "t")           # t becomes the sum on every rank
        ranks.collective("broadcast", "t", src=0)     # rank 0's t everywhere
        """
        args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
        self.run(f"dist.{op}({name}{args})")
        return self.gather(name)

    def side_by_side(self, *exprs: str) -> Table:
        """A table of each expression's value on every rank."""
        return Table({e: self.gather(e) for e in exprs})

    # --- lifetime -----------------------------------------------------------------------
    @property
    def pids(self) -> list:
        """The engines' process ids, in rank order."""
        self._check()
        return self._wait(self.view.apply_async(os.getpid))

    @property
    def running(self) -> bool:
        return self._guardian is not None and self._guardian.poll() is None

    def _check(self) -> None:
        if not self.running:
            raise RanksError("these ranks are stopped (or their cluster died): "
                             "start new ones with interactive.start()")

    def stop(self) -> None:
        """End every engine (and the controller); safe to call twice."""
        if self.client is not None:
            self.client.close()
            self.client = self.view = None
        if self._guardian is not None:
            _kill_all([self._guardian])   # SIGTERM the guardian: it kills the tree
            self._guardian = None
        import shutil
        shutil.rmtree(self.profile_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def __repr__(self) -> str:
        state = f"up, started in {self.startup_s:.1f} s" if self.running else "stopped"
        return f"Ranks(nproc={self.nproc}, backend={self.backend!r}, {state})"


def _rank_errors(error) -> list:
    """CompositeError -> [(rank, 'ValueError: ...')], the last line of each rank's error."""
    return [((info or {}).get("engine_id", "?"), f"{ename}: {evalue}")
            for ename, evalue, _tb, info in error.elist]


def start(nproc: int = 2, backend: str | None = None, timeout: float = START_TIMEOUT_S,
          group_timeout: float = GROUP_TIMEOUT_S, python: str | None = None,
          threads: int | None = None, magics: bool = True) -> Ranks:
    """Start nproc engines, join them into one process group and enable %%px; returns Ranks.

    backend: "gloo" or "nccl" (default: nccl when every rank gets a GPU, else gloo).
    python: the interpreter the engines run (default: the kernel's own).
    Raises RanksError (after stopping everything) when the engines cannot start in `timeout`.
    """
    try:
        import ipyparallel as ipp
    except ImportError as e:
        raise RanksError("interactive ranks need ipyparallel: pip install ipyparallel") from e
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1 (got {nproc})")
    backend = _pick_backend(nproc, backend)
    t0 = time.time()
    cluster_id = f"ddp-lab-{secrets.token_hex(4)}"
    profile = tempfile.mkdtemp(prefix="ddp_lab_ranks_")
    python = python or sys.executable
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env[RANKS_ENV] = cluster_id  # every process of these ranks carries it: easy to find them all
    env["OMP_NUM_THREADS"] = str(threads or max(1, (os.cpu_count() or 1) // nproc))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(loopback_env())
    cmd = [sys.executable, "-m", "ddp_lab.engine._reaper", str(os.getpid()), "--",
           sys.executable, "-m", "ipyparallel.cluster", "start", f"--n={nproc}",
           f"--profile-dir={profile}", f"--cluster-id={cluster_id}",
           f"--LocalEngineSetLauncher.engine_cmd={[python, '-m', 'ipyparallel.engine']!r}"]
    log_path = Path(profile) / "ipcluster.log"
    # A session of its own: Jupyter's stop button signals the kernel's whole process group,
    # and that must interrupt a cell, not end the ranks. Kernel death still reaches the guardian.
    with open(log_path, "w") as log:
        guardian = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
    ranks = Ranks(nproc, backend, guardian, None, profile, cluster_id)
    try:
        ranks.client = _connect(ipp, ranks, log_path, nproc, t0 + timeout)
        ranks.view = ranks.client[:]
        ids = sorted(ranks.client.ids)[:nproc]
        port = free_port()
        joins = [ranks.client[i].execute(_join_code(r, nproc, port, backend, group_timeout), block=False)
                 for r, i in enumerate(ids)]
        for j in joins:
            ranks._wait(j, interrupt_ranks=False)  # start() itself stops them all on an interrupt
    except KeyboardInterrupt:
        ranks.stop()
        print("[ranks] interrupted while starting: every engine was stopped", flush=True)
        raise
    except BaseException:
        ranks.stop()
        raise
    ranks.view = ranks.client[ids]
    ranks.view.block = True
    if magics:
        _enable_magics(ranks)
    ranks.startup_s = time.time() - t0
    print(f"[ranks] {nproc} ranks up in {ranks.startup_s:.1f} s ({backend} process group); "
          f"%%px runs a cell on all of them", flush=True)
    return ranks


def _connect(ipp, ranks: Ranks, log_path: Path, nproc: int, deadline: float):
    """Wait for the controller's connection file, then for nproc engines; fail clearly."""
    conn = Path(ranks.profile_dir) / "security" / f"ipcontroller-{ranks.cluster_id}-client.json"
    client = None
    while True:
        failed = _engines_failed(log_path)
        if not failed and not ranks.running:
            failed = f"the cluster exited with code {ranks._guardian.returncode}"
        if failed:
            raise RanksError(f"the engines could not start: {failed}\n(every process was stopped; "
                             f"ipcluster's log ends:)\n{_tail(log_path, 6)}")
        if time.time() > deadline:
            raise RanksError(f"the engines did not start in time ({_registered(client)} of {nproc} "
                             f"registered); every process was stopped. Last log lines:\n{_tail(log_path)}")
        if client is None and conn.exists():
            try:
                client = ipp.Client(str(conn))
            except Exception:  # the file is being written: try again
                client = None
        if client is not None and len(client.ids) >= nproc:
            return client
        time.sleep(0.2)


# What ipcluster logs when its engines fail; it keeps the controller running after that.
_ENGINE_FAILURES = ("Engine start failed", "Engines shutdown early", "Exception in callback")
_ERROR_LINE = re.compile(r"^\w*(Error|Exception): .*$", re.M)


def _engines_failed(path: Path) -> str:
    """'' while nothing failed; else the first error line ipcluster logged (or what failed)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    failure = next((f for f in _ENGINE_FAILURES if f in text), "")
    error = _ERROR_LINE.search(text)
    return (error.group(0) if error else failure) if failure else ""


def _registered(client) -> int:
    return 0 if client is None else len(client.ids)


def _tail(path: Path, n: int = 12) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def _enable_magics(ranks: Ranks) -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        from ddp_lab.engine._pxmagic import RankMagics
        shell.magics_manager.register(RankMagics(shell, ranks))  # %px, %%px, %autopx on these ranks
        shell.run_line_magic("pxconfig", "--progress-after -1")  # plain output, no progress widget


def figure(rows: dict, title: str = ""):
    """Tensors side by side: one row of panels per label, one column per rank, one colour scale.

    rows: label -> [tensor on rank 0, tensor on rank 1, ...], e.g. {"grad": ranks.gather("w.grad")}.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    arrays = {k: [np.atleast_2d(np.asarray(v, dtype=float)) for v in vs] for k, vs in rows.items()}
    n = max(len(v) for v in arrays.values())
    fig, axes = plt.subplots(len(arrays), n, figsize=(2.6 * n, 1.2 + 1.1 * len(arrays)), squeeze=False)
    for row, (label, values) in zip(axes, arrays.items()):
        top = max(float(np.abs(a).max()) for a in values) or 1.0
        for r, (ax, a) in enumerate(zip(row, values)):
            ax.imshow(a, cmap="RdBu_r", vmin=-top, vmax=top, aspect="auto")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"{label}, rank {r}", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
