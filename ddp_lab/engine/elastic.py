"""Elastic training on one machine (several torchrun agents, one c10d rendezvous), and a
rehearsal of the multi-node launch files with stand-in srun/scontrol/python (rehearse()).

    from ddp_lab.engine import elastic
    with elastic.Cluster("-m ddp_lab.experiments.nb10_elastic --ckpt {ckpt}") as c:
        c.start("A", host=True); c.start("B")
        c.wait(lambda recs: len(elastic.steps(recs, world_size=2)) >= 10, "10 steps on 2 nodes")
        c.kill("B")                                   # a node is lost: agent and workers, SIGKILL
        ...
    c.records                                         # every rank's JSON lines, in time order

With link="1gbit" (or any rate, see netcluster) each agent runs on a node of the localhost
cluster, added as it starts, and kill() loses the whole node: its link goes down, then every
process in its namespace is killed, as in a power cut. Without it the agents share 127.0.0.1:
the loopback of one private network namespace (ddp_lab.engine.private), so the rendezvous
store is out of the network's reach.

Each agent is `python -m torch.distributed.run --nnodes MIN:MAX --rdzv-backend c10d`, as on a
real node, started under ddp_lab.engine._reaper (which kills its whole tree when asked, or when
this kernel dies). Leaving the `with` block, normally or by an exception, stops every agent
that is still running and checks that no process of the cluster is left. The rendezvous
settings are shortened from torchrun's defaults (made for real clusters) so that a lost node
is noticed in seconds, see RDZV_CONF.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import psutil

from ddp_lab.engine import launch, netcluster, private

# torchrun's defaults: last_call 30 s, keep-alive every 5 s and a node dead after 3 missed,
# join 600 s, close 30 s. Here: 2 s of last call (then the round closes with whoever came),
# a keep-alive every second and a node declared dead after 4 missed (a busy agent writes one every 1-2 s).
RDZV_CONF = {"last_call_timeout": 2, "keep_alive_interval": 1, "keep_alive_max_attempt": 4,
             "join_timeout": 120, "close_timeout": 10}


class Cluster:
    """Agents of one elastic job on localhost; records, checkpoint and logs in one folder."""

    def __init__(self, program: str, nnodes: str = "1:2", nproc: int = 1, max_restarts: int = 3,
                 monitor_interval: float = 0.5, rdzv_conf: dict | None = None, timeout: float = 240,
                 link: str | None = None):
        if link is not None:
            launch._require_cluster(link)
        self.link = link                # each agent a node of the localhost cluster, else 127.0.0.1
        self.nodes: dict[str, int] = {}                     # agent name -> node number (its address)
        self.server: subprocess.Popen | None = None
        self.nnodes, self.nproc, self.max_restarts = nnodes, nproc, max_restarts
        self.monitor_interval = monitor_interval
        self.rdzv_conf = {**RDZV_CONF, **(rdzv_conf or {})}
        self.timeout = timeout
        self.dir = Path(tempfile.mkdtemp(prefix="ddp_lab_elastic_"))
        weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)  # when the Cluster is gone
        (self.dir / "records").mkdir()
        self.ckpt = self.dir / "elastic.pt"
        self.program = shlex.split(program.format(ckpt=self.ckpt))
        self.port = launch.free_port()
        self.agents: dict[str, subprocess.Popen] = {}
        self.events: list[tuple[float, str]] = []          # (time, what the driver did)
        self.host: str | None = None                        # the agent that serves the rendezvous store
        self.shared: private.Shared | None = None           # the local agents' private namespace

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    # -- agents --------------------------------------------------------------------------
    def address(self, name: str) -> str:
        """The agent's address: its node's on the link (nodes numbered as they start), or 127.0.0.1."""
        return netcluster.node_addr(self.nodes.setdefault(name, len(self.nodes))) if self.link else "127.0.0.1"

    def command(self, name: str, host: bool) -> list[str]:
        conf = ",".join(f"{k}={v}" for k, v in {**self.rdzv_conf, "is_host": int(host)}.items())
        me = self.address(name)
        store = me if host else self.address(self.host) if self.host else "127.0.0.1"
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", self.nnodes,
                "--nproc_per_node", str(self.nproc), "--max_restarts", str(self.max_restarts),
                "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{store}:{self.port}",
                "--rdzv_id", "ddp-lab-elastic", "--rdzv_conf", conf,
                *(["--local_addr", me] if self.link else []),
                "--monitor_interval", str(self.monitor_interval), *self.program]

    def start(self, name: str, host: bool = False) -> None:
        """Start one agent (a 'node'); the host agent serves the rendezvous store."""
        env = {**os.environ, launch.RECORDS_ENV: str(self.dir / "records"), "DDP_LAB_AGENT": name,
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "DDP_LAB_TIMEOUT": "90",
               # A fresh store per world, so a new world never reads a dead one's addresses
               # (pytorch/pytorch#167288); the program then inits with plain env://.
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               # torchrun's own logs (its --log-dir) in this cluster's folder, removed with it, not a
               # torchelastic_* folder per agent left in the temp dir
               "PET_LOG_DIR": os.environ.get("PET_LOG_DIR") or str(self.dir / "torchelastic"),
               # Agents on one machine would each number their ranks' GPUs from 0 (launch.node_gpus):
               # the rehearsal's ranks run on the CPU over gloo, with GPUs or not
               "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(launch.ROOT), os.environ.get("PYTHONPATH")]))}
        if host:
            self.host = name
        if self.link:
            extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
            self._ask(start=self.nodes.setdefault(name, len(self.nodes)), cmd=self.command(name, host),
                      env=extra, log=str(self.dir / f"agent_{name}.log"))
            self.agents[name] = _Node(self, self.nodes[name])
        else:
            if self.shared is None:  # the agents meet on the loopback of one private namespace
                self.shared = private.Shared()
            cmd = [sys.executable, "-m", "ddp_lab.engine._reaper", str(os.getpid()), "--", *self.command(name, host)]
            cmd = self.shared.enter(cmd)
            if self.shared.holder is not None:
                env = {**private.LOOPBACK_ENV, **env}
            log = open(self.dir / f"agent_{name}.log", "a", encoding="utf-8")
            self.agents[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL)
            log.close()
        self.event(f"start {name}")

    def _ask(self, **request) -> dict:
        """One request to the cluster's node server (netcluster.serve), started on first use."""
        if self.server is None:
            self.server = subprocess.Popen(
                launch._cluster_cmd(None, self.link), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, env=launch._importing_this_checkout(dict(os.environ)))
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        answer = json.loads(line) if line else {"error": f"the cluster ended (exit status {self.server.wait()})"}
        if "error" in answer:
            raise RuntimeError(f"localhost cluster, {request}: {answer['error']}")
        return answer

    def kill(self, name: str) -> dict:
        """Lose a node: SIGKILL its agent and its workers at once (no goodbye to the others). On
        the localhost cluster its link goes down first, then every process in its namespace dies:
        {"killed": pids, "links": the cluster's links after it}; on 127.0.0.1 {"killed": pids}."""
        guardian = self.agents[name]
        self.event(f"kill {name}")
        if self.link:
            return self._ask(lose=self.nodes[name])
        procs = _tree(guardian.pid)
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=10)
        guardian.wait(timeout=10)
        return {"killed": [p.pid for p in procs]}

    def stop_all(self) -> None:
        """Stop every agent still running (the guardians kill their trees), then check nothing is left."""
        guardians = [self.server] if self.link else list(self.agents.values())
        launch._kill_all([g for g in guardians if g is not None])
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        left = [p for g in guardians if g is not None for p in _tree(g.pid)]
        if left:
            raise RuntimeError(f"processes left after stopping the agents: {[p.pid for p in left]}")

    def event(self, what: str) -> None:
        self.events.append((time.time(), what))

    # -- what happened -------------------------------------------------------------------
    @property
    def records(self) -> list[dict]:
        return sorted(launch.read_records(self.dir / "records"), key=lambda r: r["t"])

    def log(self, name: str) -> str:
        return (self.dir / f"agent_{name}.log").read_text(encoding="utf-8", errors="replace")

    def wait(self, condition, what: str = "", timeout: float | None = None) -> None:
        """Poll the records until condition(records) holds; fail if an agent died or time ran out."""
        deadline = time.time() + (timeout or self.timeout)
        while not condition(self.records):
            host = self.agents.get(self.host)
            if host is not None and host.poll() is not None:  # no store, no rendezvous: nothing can change
                raise RuntimeError(f"agent {self.host}, the rendezvous host, exited while waiting for "
                                   f"{what or 'a condition'}; exit codes {self.codes()}; its last lines:\n"
                                   + "\n".join(self.log(self.host).splitlines()[-15:]))
            if time.time() > deadline:
                raise TimeoutError(f"waited {timeout or self.timeout:g} s for {what or 'a condition'}; "
                                   f"last records: {self.records[-3:]}")
            time.sleep(0.2)
        if what:
            self.event(what)

    def codes(self) -> dict:
        return {name: a.poll() for name, a in self.agents.items()}

    def wait_exit(self, names, timeout: float | None = None) -> dict[str, int]:
        """Wait for these agents to finish; their exit codes."""
        deadline = time.time() + (timeout or self.timeout)
        codes = {}
        for name in names:
            codes[name] = self.agents[name].wait(timeout=max(1, deadline - time.time()))
        self.event("finished")
        return codes


class _Node:
    """An agent on a node of the localhost cluster, asked through the node server (as Popen is)."""

    def __init__(self, cluster: Cluster, node: int):
        self.cluster, self.node = cluster, node

    def poll(self) -> int | None:
        server = self.cluster.server
        if server is None or server.poll() is not None:
            return -1
        return self.cluster._ask(poll=True)["codes"].get(str(self.node))

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.time() + (timeout if timeout is not None else 1e9)
        while (code := self.poll()) is None:
            if time.time() > deadline:
                raise subprocess.TimeoutExpired(f"node {self.node}", timeout)
            time.sleep(0.2)
        return code


def _tree(pid: int) -> list[psutil.Process]:
    try:
        me = psutil.Process(pid)
        return [me, *me.children(recursive=True)] if me.is_running() and me.status() != "zombie" \
            else me.children(recursive=True)
    except psutil.Error:
        return []


def steps(records, world_size: int | None = None, since: float = 0.0) -> list[dict]:
    """Step records of rank 0 (one per global step), optionally of one world size, after `since`."""
    return [r for r in records if r.get("kind") == "step" and r["rank"] == 0 and r["t"] >= since
            and (world_size is None or r["world_size"] == world_size)]


def phases(records) -> list[dict]:
    """Consecutive runs of steps at one world size: world_size, first and last step, times."""
    out = []
    for r in steps(records):
        if out and out[-1]["world_size"] == r["world_size"] and out[-1]["restart_key"] == (r["restart"], r["agent"]):
            out[-1].update(last=r["step"], t1=r["t"])
        else:
            out.append({"world_size": r["world_size"], "first": r["step"], "last": r["step"], "t0": r["t"],
                        "t1": r["t"], "restart_key": (r["restart"], r["agent"])})
    return out


def final_checkpoint(path) -> dict:
    import torch
    return torch.load(path, weights_only=True)


def plot(records, events, t0: float | None = None):
    """World size and global step against time, the driver's actions as vertical lines."""
    import matplotlib.pyplot as plt
    rows = steps(records)
    t0 = t0 if t0 is not None else min(t for t, _ in events)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True, height_ratios=[1, 2])
    for ph in phases(records):
        seg = [r for r in rows if ph["t0"] <= r["t"] <= ph["t1"]]
        ts = [r["t"] - t0 for r in seg]
        top.plot([ts[0], ts[-1]], [ph["world_size"]] * 2, lw=6, solid_capstyle="butt",
                 color="#4C72B0" if ph["world_size"] > 1 else "#DD8452")
        bottom.plot(ts, [r["step"] for r in seg], ".", ms=3, color="#4C72B0" if ph["world_size"] > 1 else "#DD8452")
        bottom.annotate(f"world {ph['world_size']}: steps {ph['first']}-{ph['last']}", (ts[0], ph["first"]),
                        xytext=(4, 8), textcoords="offset points", fontsize=8)
    marks: list[list] = []                                 # [time, label]: starts within 1 s share one
    for t, what in events:
        if what.startswith(("kill", "start")):
            if marks and what.startswith("start") and marks[-1][1].startswith("start") and t - marks[-1][0] < 1:
                marks[-1][1] += ", " + what.split()[-1]
            else:
                marks.append([t, what])
    for t, what in marks:
        for ax in (top, bottom):
            ax.axvline(t - t0, color="#C44E52" if what.startswith("kill") else "gray", ls="--", lw=1)
        top.text(t - t0, 2.35, what, fontsize=8, ha="center")
    top.set_ylim(0, 2.6)
    top.set_yticks([0, 1, 2])
    top.set_ylabel("world size")
    bottom.set_ylabel("global step")
    bottom.set_xlabel("seconds since the first agent started (gaps: workers restarting)")
    top.set_title("One elastic job: a node lost, the survivor continues, a node joins", fontsize=10)
    fig.tight_layout()
    return fig


# -- multi-node rehearsal: what the launch files would run on each machine ----------------------
_SRUN = """#!/usr/bin/env bash
set -eu
while [[ "$1" == --* ]]; do shift; done    # srun's own options
i=0
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  SLURM_NODEID=$i SLURMD_NODENAME=$node "$@" &
  i=$((i + 1))
done
wait
"""
_PYTHON = """#!{python}
import json, os, sys
name = os.environ.get("SLURMD_NODENAME") or "node" + os.environ.get("NODE_RANK", "?")
with open(os.path.join(os.environ["REHEARSAL_LOG"], name + ".json"), "w") as f:
    json.dump({{"argv": sys.argv[1:], "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}}, f)
"""


def rehearse(script: str, env: dict, args=(), nodes=("node07", "node08")) -> dict[str, dict]:
    """Run scripts/<script> with stand-in srun, scontrol and python: {node: what its python got}.

    For slurm_ddp.sbatch the stand-in srun starts the command once per node, as SLURM does
    with --ntasks-per-node=1; for launch_multinode.sh, call once per node with NODE_RANK set.
    """
    folder = Path(tempfile.mkdtemp(prefix="ddp_lab_rehearsal_"))
    bin_dir, log = folder / "bin", folder / "log"
    bin_dir.mkdir()
    log.mkdir()
    hostnames = "\\n".join(nodes)
    for name, text in (("srun", _SRUN), ("python", _PYTHON.format(python=sys.executable)),
                       ("scontrol", f"#!/usr/bin/env bash\nprintf '{hostnames}\\n'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    full_env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "OMP_"))},
                "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
                "REHEARSAL_LOG": str(log), **env}
    try:
        proc = subprocess.run(["bash", str(launch.SCRIPTS / script), *map(str, args)], env=full_env,
                              cwd=launch.ROOT, capture_output=True, text=True, timeout=60)
        if proc.returncode:
            raise RuntimeError(f"{script} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
        return {p.stem: json.loads(p.read_text()) for p in sorted(log.glob("*.json"))}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
