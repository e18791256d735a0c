"""The pre-flight checks, one function each: every one returns a Check (pass, warn, fail or skip)."""
from __future__ import annotations

import ipaddress
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 2**30

# What `ddp-lab doctor --json` prints, documented in its --help (ddp_lab.doctor.EPILOG).
STATUSES = {
    "pass": "it holds on this machine",
    "warn": "a job can run, but expect trouble (slow, fragile) until the fix is done",
    "fail": "a DDP job will fail here until the fix is done (or the check itself broke)",
    "skip": "it does not apply here (no GPU, one node); the detail says why",
}
FIELDS = {
    "name": "what was checked: python, torch, allreduce_gloo, master_port, ...",
    "status": "one of the values below",
    "detail": "what was found, in words",
    "fix": "what to do about a warn or a fail (\"\" when nothing needs doing)",
    "data": "the values measured (bandwidth, counts, paths) and check_s, the check's seconds",
}


@dataclass
class Check:
    name: str
    status: str          # a key of STATUSES
    detail: str
    fix: str = ""
    data: dict | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name!r}: status {self.status!r} is not one of {', '.join(STATUSES)}")

    def to_dict(self) -> dict:
        return asdict(self)


WORKBOOK = Path(__file__).resolve().parents[2]


def shown(path) -> str:
    """A path as the report prints it: inside the workbook relative to it (.venv/bin/python), under the
    home folder with ~, else whole. The JSON report's data keeps whole paths."""
    p = Path(path)
    for base, prefix in ((WORKBOOK, ""), (Path.home(), "~/")):
        try:
            return prefix + str(p.relative_to(base))
        except ValueError:
            continue
    return str(p)


def python_version(plan) -> Check:
    v = sys.version_info
    ok = v >= (3, 10)
    return Check("python", "pass" if ok else "fail", f"Python {v.major}.{v.minor}.{v.micro} at {shown(sys.executable)}",
                 "" if ok else "install Python 3.10 or newer and recreate the environment")


def torch_version(plan) -> Check:
    """Fail below the scripts' floor (nothing here runs), warn below the workbook's (scripts/ run, the
    notebooks and ddp_lab's programs need newer APIs): ddp_lab.TORCH_FLOOR, SCRIPTS_TORCH_FLOOR."""
    import torch
    from ddp_lab import SCRIPTS_TORCH_FLOOR, TORCH_FLOOR
    have = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    cuda = torch.version.cuda or "none (CPU build)"
    need, scripts = ".".join(map(str, TORCH_FLOOR)), ".".join(map(str, SCRIPTS_TORCH_FLOOR))
    detail, data = f"torch {torch.__version__}, built for CUDA {cuda}", {"torch": torch.__version__, "cuda": torch.version.cuda}
    if have < SCRIPTS_TORCH_FLOOR:
        return Check("torch", "fail", f"{detail}: older than {scripts}, the oldest torch scripts/ run on "
                     f"(the notebooks need {need})", f"pip install 'torch>={need}'", data)
    if have < TORCH_FLOOR:
        return Check("torch", "warn", f"{detail}: scripts/ run on it (from {scripts}), but the notebooks and "
                     f"ddp_lab's programs use torch {need} APIs (dist.set_timeout, torch.distributed.debug, FSDP2 on gloo)",
                     f"pip install 'torch>={need}' for the workbook; scripts/train_ddp.py as it is", data)
    return Check("torch", "pass", detail, "", data)


def _nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        return subprocess.run([exe], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None


def driver(plan) -> Check:
    import torch
    smi = _nvidia_smi()
    if smi is None:
        return Check("driver", "skip", "no nvidia-smi: no NVIDIA driver on this machine (CPU + gloo)")
    m = re.search(r"Driver Version:\s*([\d.]+).*?CUDA Version:\s*([\d.]+)", smi)
    if not m:
        return Check("driver", "warn", "nvidia-smi printed no driver version", "run nvidia-smi and read its error")
    drv, drv_cuda = m.groups()
    runtime = torch.version.cuda
    if runtime is None:
        return Check("driver", "warn", f"driver {drv} (CUDA {drv_cuda}), but torch is a CPU build",
                     "install the CUDA wheel of torch (pytorch.org, 'Get started')")
    ok = tuple(map(int, drv_cuda.split(".")[:2])) >= tuple(map(int, runtime.split(".")[:2]))
    return Check("driver", "pass" if ok else "fail",
                 f"driver {drv} supports CUDA up to {drv_cuda}; torch's runtime is CUDA {runtime}",
                 "" if ok else f"update the NVIDIA driver, or install a torch wheel built for CUDA <= {drv_cuda}")


def gpus(plan) -> Check:
    import torch
    if not torch.cuda.is_available():
        return Check("gpus", "skip", "no CUDA device visible: programs use the CPU and gloo")
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    kinds = {(p.name, round(p.total_memory / GIB)) for p in props}
    detail = f"{len(props)} GPU{'s' * (len(props) != 1)}: " + ", ".join(f"{n} {m} GiB" for n, m in sorted(kinds))
    data = {"count": len(props), "gpus": [{"name": p.name, "memory_gib": round(p.total_memory / GIB, 1)} for p in props]}
    if len(kinds) > 1:
        return Check("gpus", "warn", detail + " (not all alike)",
                     "the slowest or smallest GPU sets the pace of every step; use alike GPUs "
                     "(CUDA_VISIBLE_DEVICES) or expect stragglers", data)
    if plan.nproc > len(props):
        return Check("gpus", "warn", detail + f", {plan.nproc} processes planned",
                     f"NCCL needs one GPU per process: --nproc {len(props)}", data)
    return Check("gpus", "pass", detail, data=data)


def backends(plan) -> Check:
    import torch.distributed as dist
    have = [b for b, f in (("gloo", dist.is_gloo_available), ("nccl", dist.is_nccl_available),
                           ("mpi", dist.is_mpi_available)) if f()]
    if "gloo" not in have:
        return Check("backends", "fail", f"available: {have or 'none'}; gloo is missing",
                     "install the official torch wheel (gloo ships with it)", {"available": have})
    import torch
    if torch.cuda.is_available() and "nccl" not in have:
        return Check("backends", "warn", f"available: {', '.join(have)}; GPUs but no NCCL",
                     "install a CUDA build of torch on Linux for NCCL", {"available": have})
    return Check("backends", "pass", f"available: {', '.join(have)}", data={"available": have})


def allreduce(plan) -> list[Check]:
    from ddp_lab.doctor.allreduce import measure
    out = []
    import torch
    gpus_n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for backend in ("gloo", "nccl"):
        if backend == "nccl" and gpus_n < 2:
            out.append(Check("allreduce_nccl", "skip", f"{gpus_n} GPU{'s' * (gpus_n != 1)}: an NCCL all-reduce needs two"))
            continue
        r = measure(2, backend, megabytes=64 if backend == "nccl" else 16)
        if not r["ok"]:
            out.append(Check(f"allreduce_{backend}", "fail", f"2-process {backend} all-reduce failed: {r['error']}",
                             "see notebook 07's deep dive on launch and rendezvous failures; try GLOO_SOCKET_IFNAME=lo (or NCCL_SOCKET_IFNAME)", r))
            continue
        detail = (f"2 processes, {r['megabytes']:g} MB: {r['seconds'] * 1e3:.1f} ms, "
                  f"bus bandwidth {r['busbw_gbs']:.2f} GB/s")
        out.append(Check(f"allreduce_{backend}", "pass", detail, data=r))
    return out


def across_nodes(plan) -> Check:
    """With --node-rank on every node: a real all-reduce between the nodes, through node 0's address."""
    node_rank = getattr(plan, "node_rank", None)
    if plan.nnodes < 2 or node_rank is None:
        why = "one node planned" if plan.nnodes < 2 else "no --node-rank given"
        return Check("across_nodes", "skip", f"{why}: run `ddp-lab doctor --nnodes N --node-rank K --master-addr "
                     "NODE0` on every node at once to test the link between them")
    if not 0 <= node_rank < plan.nnodes:
        return Check("across_nodes", "fail", f"--node-rank {node_rank} is not in 0..{plan.nnodes - 1}",
                     "number the nodes 0 to --nnodes - 1, node 0 at --master-addr")
    wrong = _master_unreachable_by_name(plan.master_addr) if node_rank != 0 else None
    if wrong:  # at once: waiting two minutes for node 0 where it cannot be found tells nothing more
        return Check("across_nodes", "fail", wrong, f"give node 0's IP address as --master-addr, or map "
                     f"{plan.master_addr} to it in this node's /etc/hosts (or DNS)")
    from ddp_lab.doctor.allreduce import across
    r = across(node_rank, plan.nnodes, plan.master_addr, plan.master_port)
    where = f"{plan.master_addr}:{plan.master_port}"
    if not r["ok"]:
        fix = (f"start the doctor on all {plan.nnodes} nodes within two minutes; open port {plan.master_port} "
               f"on node 0; check that {plan.master_addr} resolves to node 0's network address on every node "
               "(not 127.x: /etc/hosts); set GLOO_SOCKET_IFNAME to the interface the nodes share")
        if "torch differs" in r["error"]:
            fix = "install the same torch on every node (pip install torch==VERSION, in each node's environment)"
        return Check("across_nodes", "fail", f"all-reduce with the other nodes through {where} failed: {r['error']}",
                     fix, r)
    detail = (f"node {node_rank} of {plan.nnodes}, through {where}, {r['megabytes']:g} MB: "
              f"{r['seconds'] * 1e3:.0f} ms, bus bandwidth {r['busbw_gbs'] * 1e3:.1f} MB/s")
    return Check("across_nodes", "pass", detail, data=r)


def _master_unreachable_by_name(addr: str) -> str:
    """Why node 0 cannot be reached at `addr` from this node, found by name resolution alone; '' if
    it may be. A name that resolves to loopback here (a hosts file mapping node 0's name to 127.x)
    makes this node look for node 0 on itself; a loopback address typed as such means one machine."""
    try:
        ips = {ipaddress.ip_address(a[4][0].split("%")[0]) for a in socket.getaddrinfo(addr, None)}
    except OSError as e:
        return f"--master-addr {addr} does not resolve on this node ({e})"
    typed_loopback = addr == "localhost" or _is_ip(addr) and ipaddress.ip_address(addr).is_loopback
    if all(ip.is_loopback for ip in ips) and not typed_loopback:
        return (f"--master-addr {addr} resolves to {', '.join(map(str, sorted(ips, key=str)))} on this node, "
                "a loopback address: this node would look for node 0 on itself (name resolution, not the network)")
    return ""


def _is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        return False


def master_port(plan) -> Check:
    addr, port = plan.master_addr, plan.master_port
    if getattr(plan, "node_rank", None) not in (None, 0):
        return Check("master_port", "skip", f"node 0 listens on {addr}:{port}; this node connects to it "
                     "(across_nodes tests that)")
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((socket.gethostbyname(addr), port))
    except OSError as e:
        return Check("master_port", "warn", f"{addr}:{port} is not free here ({e.strerror or e})",
                     "another job holds it: pick another --master_port, or --standalone on one node; "
                     "`ss -ltnp` shows the owner")
    return Check("master_port", "pass", f"{addr}:{port} is free to listen on")


def hostname(plan) -> Check:
    name = socket.gethostname()
    try:
        ip = socket.gethostbyname(name)
    except OSError as e:
        return Check("hostname", "fail", f"{name!r} does not resolve ({e})",
                     f"add '{name}' to /etc/hosts, or use an IP address as MASTER_ADDR")
    if ip.startswith("127.") and plan.nnodes > 1:
        return Check("hostname", "warn", f"{name} resolves to {ip}, a loopback address",
                     "other nodes cannot reach it by name: use this machine's LAN IP as MASTER_ADDR and set "
                     "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME to its interface")
    return Check("hostname", "pass", f"{name} resolves to {ip}")


def shm(plan) -> Check:
    if not Path("/dev/shm").exists():
        return Check("shm", "skip", "no /dev/shm on this system (DataLoader workers use other shared memory)")
    free = shutil.disk_usage("/dev/shm").total / GIB
    if free < 1:
        return Check("shm", "warn", f"/dev/shm is {free * 1024:.0f} MiB",
                     "DataLoader workers pass batches through /dev/shm ('bus error' when it fills): "
                     "docker run --shm-size=8g, or num_workers=0")
    return Check("shm", "pass", f"/dev/shm is {free:.1f} GiB")


def open_files(plan) -> Check:
    try:
        import resource
    except ImportError:  # Windows
        return Check("open_files", "skip", "no open-file limit to read on this system")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 1024 * max(1, plan.nproc)
    if soft != resource.RLIM_INFINITY and soft < need:
        return Check("open_files", "warn", f"open-file limit {soft} (hard {hard}) for {plan.nproc} processes",
                     f"ulimit -n {min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536} before "
                     "launching ('Too many open files' from DataLoader workers and sockets)")
    return Check("open_files", "pass", f"open-file limit {soft} (hard {hard})")


def cores(plan) -> Check:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    data = {"cores": n, "nproc": plan.nproc, "threads_per_process": max(1, n // plan.nproc)}
    if plan.nproc > n:
        return Check("cores", "warn", f"{n} core{'s' * (n != 1)} for {plan.nproc} processes: they will take turns",
                     f"plan at most {n} CPU processes (or use GPUs); OMP_NUM_THREADS=1", data)
    return Check("cores", "pass", f"{n} core{'s' * (n != 1)} for {plan.nproc} processes: OMP_NUM_THREADS="
                 f"{data['threads_per_process']} each", data=data)


def disk(plan) -> Check:
    folder = Path(plan.ckpt_dir)
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free / GIB
    if free < plan.min_free_gib:
        return Check("disk", "warn", f"{free:.1f} GiB free in {folder} for checkpoints",
                     f"free space or point --ckpt-dir elsewhere: a torn save can lose the last good checkpoint",
                     {"free_gib": round(free, 1)})
    return Check("disk", "pass", f"{free:.1f} GiB free in {folder}", data={"free_gib": round(free, 1)})


def torchrun_on_path(plan) -> Check:
    exe = shutil.which("torchrun")
    # the Python running the doctor, the one with torch: `python3` on PATH may be another
    run = f"{shlex.quote(sys.executable)} -m torch.distributed.run"
    if not exe:
        return Check("torchrun", "warn", "no torchrun on PATH",
                     f"run {run} instead (the same flags), or activate this environment", {"use": run})
    first = Path(exe).read_bytes()[:300].split(b"\n")[0].decode(errors="replace")
    runs = first[2:].strip().split()[0] if first.startswith("#!") else exe
    same = _same_python(runs, sys.executable)
    if not same:
        return Check("torchrun", "warn", f"torchrun on PATH ({shown(exe)}) runs {shown(runs)}, not this Python ({shown(sys.executable)})",
                     f"activate this environment first, or run {run} instead (the same flags)",
                     {"torchrun": exe, "python": runs, "use": run})
    return Check("torchrun", "pass", f"{shown(exe)} runs this Python", data={"torchrun": exe})


def _same_python(a: str, b: str) -> bool:
    # A venv's python is a symlink to the base interpreter: compare folders, not link targets.
    return Path(a).absolute().parent == Path(b).absolute().parent


def localhost_cluster(plan) -> Check:
    """Whether launches can put nodes in network namespaces of their own, joined by a shaped link
    (launch.torchrun(..., link=...): the multi-node cells of the lessons), and what a local launch
    listens on (ddp_lab.engine.private), first."""
    from ddp_lab.engine import netcluster, private
    launches = f"launches: {private.mode()}"
    ok, why = netcluster.available()
    if ok:
        return Check("cluster", "pass", f"{launches}; nodes in network namespaces joined by a shaped link: "
                     "available (launch.torchrun(..., nnodes=2, link='1gbit'))", data={"launches": private.mode()})
    return Check("cluster", "skip", f"{launches}; localhost cluster not available: {why}",
                 data={"why": why, "launches": private.mode()})


ALL = [python_version, torch_version, driver, gpus, backends, allreduce, master_port, hostname, shm,
       open_files, cores, disk, torchrun_on_path, localhost_cluster, across_nodes]
