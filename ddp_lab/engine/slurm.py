"""A real SLURM on this machine: munge, a controller and one slurmd per node, started for a test
or a notebook cell, and gone after it.

    from ddp_lab.engine import slurm
    slurm.available()                      # (True, "") or (False, one line: why, and the fix)
    with slurm.Slurm(nodes=2, link="1gbit") as s:
        job = s.sbatch(["scripts/slurm_ddp.sbatch", "--epochs", "1"], wait=True)
        s.job(job)["JobState"]             # "COMPLETED"
        s.run(["squeue"]).stdout

Each node is a network namespace of the localhost cluster (ddp_lab.engine.netcluster) with a
hostname of its own (node0, node1, ...: a UTS namespace), joined to the others by a link of
`link`. The controller (hostname `ctl`, 10.77.0.254 on the bridge) and every command given to
run() live in the namespace that holds the bridge, which plays the login node. So nothing any
daemon or job opens is reachable from outside these namespaces, and the jobs' ports never meet
the host's. The daemons' config, state, munge key and logs live in one scratch folder (`.dir`),
removed when the `with` block ends (kept with keep=True, or when the block fails: its logs are there).
Tasks are bound to their CPUs as at a site that binds them by default (task/affinity), so a job
sees the CPUs SLURM gave it (`.unbound` says why not, where this machine cannot).

SLURM's daemons run as root (slurmd starts jobs as their user), so this needs root, as in CI, a
container or a VM, and Debian's packages: `apt-get install slurmctld slurmd slurm-client munge`.
Leaving the `with` block, normally, by an error or an interrupt, kills every daemon and job; the
launcher's guardian does the same when the kernel dies.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddp_lab.engine import launch, netcluster

CONTROLLER = "10.77.0.254"   # the login node's address on the bridge, inside the namespaces only
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
INSTALL = "`sudo apt-get install slurmctld slurmd slurm-client munge` (Debian, Ubuntu)"
CONF = """ClusterName=ddplab
SlurmctldHost=ctl({controller})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket,cred_expire=5
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin={task}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout=6
SchedulerParameters=bf_interval=1,sched_interval=2
SlurmdParameters=config_overrides
GresTypes=gpu
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


# Tasks bound to their CPUs, as on a site that binds them by default: task/affinity, and a default
# binding where its auto-binding finds no match. Plain task/affinity left one task on a node of 2
# sockets unbound (measured with 22.05: 2 CPUs with or without srun's --cpus-per-task), which hid the
# pitfall. Threads, not cores, so that a task of 1 CPU should get 1 CPU on a machine with SMT too
# (expected: this one has none).
BINDING = "task/affinity\nTaskPluginParam=autobind=threads"


def binding(cpus: int) -> str:
    """"" where slurmd can bind tasks to the CPUs a node offers (0..cpus-1), else one line: why not."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    missing = sorted(set(range(cpus)) - allowed)
    if missing:
        return (f"tasks are not bound to CPUs here (TaskPlugin=task/none): each node offers CPUs 0-{cpus - 1}, "
                f"and this machine lets us use only {sorted(allowed)}")
    return ""


def available() -> tuple[bool, str]:
    """(True, "") where a localhost SLURM can start here, else (False, one line: why, and the fix)."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return False, f"SLURM is not installed here (no {', '.join(missing)}): {INSTALL}"
    if os.geteuid() != 0:
        return False, ("SLURM's daemons run as root (slurmd starts jobs as their user): run as root, "
                       "e.g. in a container or VM, or submit to a real cluster")
    ok, why = netcluster.available()
    if not ok:
        return False, f"SLURM's nodes are nodes of the localhost cluster, and {why}"
    return True, ""


# -- inside the namespaces: the daemons, and the commands run on the login node ----------------------
def _conf(folder: str, nodes: int, cpus: int, gpus: int) -> None:
    lines = "\n".join(f"NodeName=node{k} NodeAddr={netcluster.node_addr(k)} CPUs={cpus} Gres=gpu:fake:{gpus} "
                      "State=UNKNOWN" for k in range(nodes))
    task = "task/none" if binding(cpus) else BINDING
    Path(folder, "slurm.conf").write_text(CONF.format(controller=CONTROLLER, dir=folder, nodes=lines, task=task))
    # Stand-in GPUs: files in the scratch folder, so a job may ask for --gpus-per-node and gets
    # SLURM_GPUS_ON_NODE (SLURM's gpu plugin wants a File per GPU; its ranks run on the CPU anyway)
    for g in range(gpus):
        Path(folder, f"gpu{g}").touch()
    Path(folder, "gres.conf").write_text(f"Name=gpu Type=fake File={folder}/gpu[0-{gpus - 1}]\n")
    for k in range(nodes):
        os.makedirs(f"{folder}/spool/node{k}", exist_ok=True)
    os.makedirs(f"{folder}/state", exist_ok=True)
    key = Path(folder, "munge.key")
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)


def _out(folder: str) -> dict:
    """Popen's arguments for a daemon: SLURM's config, and its output appended to daemons.log."""
    return dict(stdout=open(f"{folder}/daemons.log", "a"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "SLURM_CONF": f"{folder}/slurm.conf"})


def _daemons(folder: str, nodes: int) -> list[subprocess.Popen]:
    out = _out(folder)
    procs = [subprocess.Popen(["munged", "--foreground", "--force", f"--key-file={folder}/munge.key",
                               f"--socket={folder}/munge.socket", f"--pid-file={folder}/munged.pid",
                               f"--log-file={folder}/munged.log", f"--seed-file={folder}/munge.seed"], **out)]
    deadline = time.time() + 10
    while not os.path.exists(f"{folder}/munge.socket") and time.time() < deadline:
        time.sleep(0.05)
    procs.append(subprocess.Popen(["slurmctld", "-D", "-i"], **out))
    return procs + [_slurmd(folder, k, out) for k in range(nodes)]


def _slurmd(folder: str, k: int, out: dict) -> subprocess.Popen:
    # nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs the host's /sys/fs/cgroup
    return subprocess.Popen(["nsenter", f"--net=/run/netns/node{k}", "unshare", "--uts", "sh", "-c",
                             f"hostname node{k} && exec slurmd -D -N node{k}"], **out)


def _crash(k: int) -> list[int]:
    """Node k goes down as in a power cut: SIGKILL to everything on it (slurmd, the job's step
    daemons, torchrun and its workers), with no time to tell anyone. Its link stays."""
    pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", f"node{k}"], capture_output=True,
                                           text=True).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return pids


def serve(folder: str, nodes: int, link: str, cpus: int, gpus: int) -> int:
    """The login node: build the nodes, start the daemons, then run the commands asked on stdin
    ({"run": argv, "cwd": ..., "env": {...}, "timeout": s}), answering each on stdout."""
    started = time.time()
    netcluster.build(nodes, netcluster.rate_bits(link))
    subprocess.run(["hostname", "ctl"], check=True)   # the login node (its own UTS namespace)
    subprocess.run(["ip", "addr", "add", f"{CONTROLLER}/24", "dev", "br0"], check=True, capture_output=True)
    with open("/etc/hosts", "a") as f:     # the cluster's own copy (netcluster.build mounted it)
        f.write(f"{CONTROLLER} ctl\n")
    _conf(folder, nodes, cpus, gpus)
    procs = _daemons(folder, nodes)
    env = {**os.environ, "SLURM_CONF": f"{folder}/slurm.conf"}
    state = ""
    while time.time() < started + 30:
        state = subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=env, capture_output=True, text=True).stdout.strip()
        if state == f"idle {nodes}":
            break
        time.sleep(0.1)
    else:
        print(json.dumps({"error": f"the nodes did not come up within 30 s (sinfo: {state or 'nothing'}); "
                                   f"see {folder}/daemons.log"}), flush=True)
        return 3
    print(json.dumps({"ready": round(time.time() - started, 2), "binding": binding(cpus)}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if "crash" in req:
            print(json.dumps({"killed": _crash(req["crash"])}), flush=True)
            continue
        if "boot" in req:     # the node is back: its slurmd registers, and ReturnToService=2 returns it
            procs.append(_slurmd(folder, req["boot"], _out(folder)))
            print(json.dumps({"booted": req["boot"]}), flush=True)
            continue
        try:
            p = subprocess.run(req["run"], cwd=req.get("cwd"), env={**env, **req.get("env", {})},
                               capture_output=True, text=True, timeout=req.get("timeout", 120))
            answer = {"code": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
        except subprocess.TimeoutExpired as e:
            answer = {"code": 124, "stdout": e.stdout or "", "stderr": f"timed out after {e.timeout:g} s"}
        except OSError as e:
            answer = {"code": 127, "stdout": "", "stderr": str(e)}
        print(json.dumps(answer), flush=True)
    for p in procs:
        p.terminate()
    return 0


# -- outside: the client ---------------------------------------------------------------------------
class Slurm:
    """A localhost SLURM of `nodes` nodes joined by `link`, for the length of a `with` block."""

    def __init__(self, nodes: int = 2, link: str = "1gbit", cpus: int = 2, gpus: int = 4, timeout: float = 60,
                 keep: bool = False):
        ok, why = available()
        if not ok:
            raise launch.ClusterUnavailable(why)
        self.nodes, self.link, self.cpus, self.gpus, self.timeout = nodes, link, cpus, gpus, timeout
        self.dir = Path(tempfile.mkdtemp(prefix="ddp_lab_slurm_"))
        self.server: subprocess.Popen | None = None
        self.ready_s: float | None = None
        self.unbound = ""    # "" where tasks are bound to their CPUs, else one line: why not
        # The scratch folder (config, state, munge key, daemons' logs) goes when the block ends, unless
        # keep=True or the block failed: then it stays for its logs, and the error names it
        self.keep = keep

    def __enter__(self) -> "Slurm":
        # if this kernel dies, the guardian stops the daemons and removes the scratch folder
        cmd = [sys.executable, "-m", "ddp_lab.engine._reaper", str(os.getpid()),
               *([] if self.keep else ["--rm", str(self.dir)]), "--",
               "unshare", "--net", "--mount", "--uts", sys.executable, "-m", "ddp_lab.engine.slurm", "--serve",
               "--dir", str(self.dir), "--nodes", str(self.nodes), "--link", self.link,
               "--cpus", str(self.cpus), "--gpus", str(self.gpus)]
        self.server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       text=True, env=launch._importing_this_checkout(dict(os.environ)))
        try:
            ready = self._answer(self.timeout)
            self.ready_s, self.unbound = ready["ready"], ready["binding"]
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if exc_type is None and not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _answer(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        line = self.server.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the localhost SLURM did not answer within {timeout:g} s "
                               f"(exit status {self.server.poll()}); its logs: {self.dir}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the localhost SLURM did not start: {answer['error']}")
        return answer

    def run(self, argv, cwd=None, env: dict | None = None, timeout: float = 120,
            check: bool = True) -> subprocess.CompletedProcess:
        """Run a command on the login node (sbatch, scontrol, scancel, ...), as a user would."""
        argv = [str(a) for a in argv]
        # Jobs inherit this environment (sbatch --export=ALL): gloo on the nodes' link, and no GPU,
        # as on the localhost cluster (NCCL between GPUs of one machine would bypass the link)
        # and torchrun's per-rank logs in this cluster's folder, removed with it (else a torchelastic_*
        # folder in the nodes' temp dir per job step, never removed)
        env = {"GLOO_SOCKET_IFNAME": netcluster.IFNAME, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable,
               "PET_LOG_DIR": os.environ.get("PET_LOG_DIR") or str(self.dir / "torchelastic"), **(env or {})}
        a = self._ask({"run": argv, "cwd": str(cwd or launch.ROOT), "env": env, "timeout": timeout}, timeout + 15)
        done = subprocess.CompletedProcess(argv, a["code"], a["stdout"], a["stderr"])
        if check and done.returncode:
            last = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[-1]
            raise RuntimeError(f"`{' '.join(argv[:2])} ...` failed ({done.returncode}): {last}")
        return done

    def sbatch(self, args, wait: bool = False, env: dict | None = None, timeout: float = 240) -> str:
        """Submit a batch job (sbatch ARGS); its job id. wait=True returns once it has ended, as
        `sbatch --wait` would (which polls at 2 s and more: here every 0.25 s)."""
        done = self.run(["sbatch", *args], env=env, check=False)
        m = re.search(r"Submitted batch job (\d+)", done.stdout)
        if not m:
            raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
        if wait:
            self.wait(m.group(1), timeout)
        return m.group(1)

    def wait(self, job_id: str, timeout: float = 240) -> dict[str, str]:
        """Until the job has ended (any state but PENDING, RUNNING, CONFIGURING, COMPLETING...): its record."""
        deadline = time.time() + timeout
        while (job := self.job(job_id))["JobState"] in ACTIVE:
            if time.time() > deadline:
                raise TimeoutError(f"job {job_id} still {job['JobState']} after {timeout:g} s; logs in {self.dir}")
            time.sleep(0.25)
        return job

    def crash(self, node: int) -> list[int]:
        """Node `node` goes down as in a power cut (everything on it killed at once); the pids killed."""
        return self._ask({"crash": node})["killed"]

    def boot(self, node: int) -> None:
        """The crashed node is back: its slurmd starts again and registers with the controller."""
        self._ask({"boot": node})

    def node(self, name: str) -> dict[str, str]:
        """`scontrol show node` as a dict: State, Reason..."""
        text = self.run(["scontrol", "show", "node", "-o", name]).stdout
        return dict(kv.split("=", 1) for kv in text.split() if "=" in kv)

    def _ask(self, req: dict, timeout: float = 30) -> dict:
        self.server.stdin.write(json.dumps(req) + "\n")
        self.server.stdin.flush()
        return self._answer(timeout)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (no accounting here, so no sacct): JobState, ExitCode, NodeList..."""
        text = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(kv.split("=", 1) for kv in text.split() if "=" in kv)

    def stop(self) -> None:
        if self.server is None:
            return
        if self.server.poll() is None:
            try:
                self.server.stdin.close()
                self.server.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        launch._kill_all([self.server])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", action="store_true", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--gpus", type=int, default=4)
    a = ap.parse_args(argv)
    return serve(a.dir, a.nodes, a.link, a.cpus, a.gpus)


if __name__ == "__main__":
    sys.exit(main())
