"""Several nodes on one machine, joined by a real, slow link: network namespaces and shaped veth pairs.

    from ddp_lab.engine import launch, netcluster
    netcluster.available()                      # (True, "") or (False, the one line that says why)
    launch.torchrun("-m ddp_lab.experiments.nb00_hello", nproc=1, nnodes=2, link="100mbit")

What `launch.torchrun(..., link=RATE)` builds, as an ordinary user: `unshare --user --map-root-user
--net --mount` gives one process a user namespace of its own, in which it may create network
namespaces. This module, run there (`python -m ddp_lab.engine.netcluster`), then

- makes one network namespace per node (`ip netns add`), each with its own loopback: the ranks of
  a node talk over it, at loopback speed;
- joins the nodes through a bridge: each node has a veth `ddp0` (address 10.77.0.N+1), shaped to
  RATE with `tc ... tbf` at both of its ends, so everything between nodes crosses a link of RATE;
- starts each node's command inside its namespace (`ip netns exec`), with GLOO_SOCKET_IFNAME=ddp0,
  and exits with the first failing node's status once every node has ended.

Every address exists only inside namespaces this process created, and they all vanish with the
last process in them: on exit, timeout, interrupt or a dead kernel (the launcher's guardian kills
the tree) nothing is left. RATE is tc's syntax ("100mbit", "1gbit") or "unshaped" (veth at
loopback speed).

Inside a node (a rank, or the node's command), shape(RATE) sets the rate of what that node sends,
and tx_bytes() reads how many bytes it has sent over its link. On a cluster launched unshaped,
every node calling shape(RATE) makes the link RATE in both directions: one launch can measure
several rates (notebook 08).

With --serve it starts nodes on request instead, and loses them on request: its link goes down,
then every process in its namespace is killed (serve(); elastic.Cluster(link=...), notebook 10).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time

from ddp_lab.engine import private

SUBNET = "10.77.0"          # node k is SUBNET.(k+1), inside the namespaces only
IFNAME = "ddp0"             # each node's end of its link (the same name in every node)
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
OFF_ENV = "DDP_LAB_CLUSTER"
UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount"]
PROBE = ("ip link add name probe0 type veth peer name probe1 && "
         "tc qdisc add dev probe0 root tbf rate 10mbit burst 32kb latency 50ms")


def node_addr(k: int) -> str:
    return f"{SUBNET}.{k + 1}"


def rate_bits(link: str) -> float | None:
    """Bits per second of a tc rate ("100mbit", "1gbit"); None for "unshaped"."""
    if link == "unshaped":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", link.strip().lower())
    if not m:
        raise ValueError(f"link={link!r}: give a rate as tc writes it, e.g. '100mbit' or '1gbit', or 'unshaped'")
    bits = float(m.group(1)) * UNITS[m.group(2)]
    if bits < 1e6:
        raise ValueError(f"link={link!r}: at least 1mbit (slower links make every launch take minutes)")
    return bits


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """(True, "") where this machine can build the cluster, else (False, one line: why, and the fix).
    DDP_LAB_CLUSTER=off turns it off (the lessons' link cells then skip, as where it cannot work)."""
    if os.environ.get(OFF_ENV, "").lower() in ("0", "off", "no", "false"):
        return False, f"the localhost cluster is turned off ({OFF_ENV}={os.environ[OFF_ENV]}); unset it to use it"
    if not sys.platform.startswith("linux"):
        return False, ("the localhost cluster needs Linux network namespaces; on macOS or Windows run the "
                       "multi-node cells in a Linux VM or WSL2")
    missing = private.not_found(("unshare", "ip", "tc"))
    if missing:
        return False, (f"the localhost cluster needs {missing} (util-linux, iproute2), found neither on PATH nor in "
                       f"{', '.join(private.SBIN)}: install them, e.g. `sudo apt-get install iproute2 util-linux`")
    env = {**os.environ, "PATH": private.with_sbin(os.environ.get("PATH"))}
    try:
        userns = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=20, env=env)
        links = subprocess.run([*UNSHARE, "sh", "-c", PROBE], capture_output=True, text=True, timeout=20, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"the localhost cluster could not start `unshare` ({e})"
    if userns.returncode != 0:
        why = (userns.stderr.strip().splitlines() or ["no message"])[-1]
        return False, ("unprivileged user namespaces are not allowed here "
                       f"({why}): enable them (sysctl user.max_user_namespaces, or "
                       "kernel.unprivileged_userns_clone=1 on Debian kernels) or run outside a container "
                       "that blocks unshare")
    if links.returncode != 0:
        why = (links.stderr.strip().splitlines() or ["no message"])[-1]
        return False, (f"a shaped veth link cannot be made here ({why}): the kernel needs veth and the "
                       "tbf qdisc (modules veth, sch_tbf)")
    return True, ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _shape(ns: str | None, dev: str, bits: float | None) -> None:
    if bits is None:
        return
    burst = max(32 * 1024, int(bits / 8 * 0.004))  # 4 ms of traffic: small beside a transfer
    cmd = ["tc", *(["-n", ns] if ns else []), "qdisc", "add", "dev", dev, "root", "tbf",
           "rate", f"{int(bits)}bit", "burst", str(burst), "latency", "100ms"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _in_node(what: str) -> None:
    if os.environ.get("GLOO_SOCKET_IFNAME") != IFNAME or not os.path.exists(f"/sys/class/net/{IFNAME}"):
        raise RuntimeError(f"netcluster.{what} works on a node of the localhost cluster: call it from a "
                           "program started by launch.torchrun(..., nnodes=2, link=...)")


def shape(link: str) -> None:
    """On a node of the cluster: send at `link` from now on ("100mbit", or "unshaped" for none).
    It shapes this node's end of its link only: call it on every node (then a barrier), on a
    cluster launched with link="unshaped", and each direction runs at `link`."""
    bits = rate_bits(link)
    _in_node("shape()")
    subprocess.run(["tc", "qdisc", "del", "dev", IFNAME, "root"], capture_output=True)  # none is fine
    _shape(None, IFNAME, bits)


def tx_bytes() -> int:
    """On a node of the cluster: bytes this node has sent over its link so far (headers included)."""
    _in_node("tx_bytes()")
    with open(f"/sys/class/net/{IFNAME}/statistics/tx_bytes") as f:
        return int(f.read())


def _hosts(names) -> None:
    """Name the nodes' addresses (node0, node1, ...) in this mount namespace's /etc/hosts, so that
    a peer's address resolves: c10d looks each connection's peer up and warns when it cannot. Best
    effort: where /etc/hosts cannot be covered, the cluster works the same, with those warnings."""
    try:
        with open("/etc/hosts") as f:
            mine = f.read()
    except OSError:
        mine = "127.0.0.1 localhost\n"
    with open("/run/hosts", "w") as f:
        # c10d's store listens on IPv6 too, and sees an IPv4 peer as ::ffff:10.77.0.N
        f.write(mine + "".join(f"{node_addr(k)} {ns}\n::ffff:{node_addr(k)} {ns}\n" for k, ns in enumerate(names)))
    subprocess.run(["mount", "--bind", "/run/hosts", "/etc/hosts"], capture_output=True)


def build(nodes: int, bits: float | None) -> list[str]:
    """Inside the user namespace: the bridge, then the node namespaces and their shaped links."""
    # ip and tc by name, here and on the nodes (shape()), also where PATH lacks /usr/sbin
    os.environ["PATH"] = private.with_sbin(os.environ.get("PATH"))
    subprocess.run(["mount", "-t", "tmpfs", "ddp-lab-netns", "/run"], check=True, capture_output=True)
    os.makedirs("/run/netns", exist_ok=True)
    _ip("link", "set", "lo", "up")
    _ip("link", "add", "br0", "type", "bridge")
    _ip("link", "set", "br0", "up")
    _hosts([f"node{k}" for k in range(max(nodes, 8))])
    return [add_node(k, bits) for k in range(nodes)]


def add_node(k: int, bits: float | None) -> str:
    """Node k: its namespace, and a veth from it to the bridge, shaped both ways."""
    ns = f"node{k}"
    _ip("netns", "add", ns)
    _ip("-n", ns, "link", "set", "lo", "up")
    _ip("link", "add", f"h{k}", "type", "veth", "peer", "name", IFNAME, "netns", ns)
    _ip("link", "set", f"h{k}", "master", "br0")
    _ip("link", "set", f"h{k}", "up")
    _ip("-n", ns, "addr", "add", f"{node_addr(k)}/24", "dev", IFNAME)
    _ip("-n", ns, "link", "set", IFNAME, "up")
    _shape(ns, IFNAME, bits)     # what the node sends
    _shape(None, f"h{k}", bits)  # what it receives
    return ns


def lose_node(k: int, timeout: float = 10) -> list[int]:
    """Node k is lost, as a machine that loses power: its link goes down first (no packet of its
    dying sockets reaches anyone), then every process in its namespace gets SIGKILL, then the
    namespace goes. Returns the pids it killed; raises if any is still alive after `timeout` s."""
    ns = f"node{k}"
    _ip("link", "del", f"h{k}")          # the pair goes: node k's end, ddp0, with it
    deadline, killed = time.time() + timeout, []
    while True:
        pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                               text=True).stdout.split()]
        if not pids:
            break
        if time.time() > deadline:
            raise RuntimeError(f"{ns}: processes {pids} outlived SIGKILL for {timeout:g} s")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed += [p for p in pids if p not in killed]
        time.sleep(0.05)
    _ip("netns", "del", ns)
    return killed


def _links() -> list[str]:
    """The links of this (the cluster's) namespace: the bridge and each node's far end, h<k>."""
    out = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    return [line.split()[0].split("@")[0] for line in out.splitlines() if line.strip()]


def serve(bits: float | None) -> int:
    """Nodes on request (the elastic lesson): one JSON request per line on stdin, one JSON answer
    per line on stdout. {"start": k, "cmd": [...], "env": {...}, "log": path} adds node k if it is
    new and starts cmd in it; {"lose": k} loses node k (lose_node); {"poll": true} gives every
    started command's exit code (null while it runs). End of stdin ends every node."""
    build(0, bits)
    procs: dict[int, subprocess.Popen] = {}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if "start" in req:
                k = int(req["start"])
                if not os.path.exists(f"/run/netns/node{k}"):
                    add_node(k, bits)
                with open(req["log"], "a", encoding="utf-8") as log:
                    procs[k] = subprocess.Popen(
                        ["ip", "netns", "exec", f"node{k}", *req["cmd"]], stdin=subprocess.DEVNULL,
                        stdout=log, stderr=subprocess.STDOUT,
                        env={**os.environ, "GLOO_SOCKET_IFNAME": IFNAME, **req.get("env", {})})
                answer = {"pid": procs[k].pid}
            elif "lose" in req:
                k = int(req["lose"])
                answer = {"killed": lose_node(k), "links": _links()}
                procs[k].wait(timeout=10)
            else:
                answer = {"codes": {k: p.poll() for k, p in procs.items()}}
        except (subprocess.CalledProcessError, RuntimeError, OSError, KeyError) as e:
            answer = {"error": f"{type(e).__name__}: {getattr(e, 'stderr', '') or e}"}
        print(json.dumps(answer), flush=True)
    for p in procs.values():
        p.kill()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link", required=True, help="tc rate, e.g. 100mbit, or unshaped")
    ap.add_argument("--commands", help="JSON: one argv per node")
    ap.add_argument("--envs", default="", help="JSON: extra environment per node")
    ap.add_argument("--serve", action="store_true", help="start nodes on request, from stdin (serve())")
    a = ap.parse_args(argv)
    if a.serve:
        return serve(rate_bits(a.link))
    commands = json.loads(a.commands)
    envs = json.loads(a.envs) if a.envs else [{} for _ in commands]
    try:
        names = build(len(commands), rate_bits(a.link))
    except subprocess.CalledProcessError as e:
        print(f"localhost cluster: `{' '.join(e.cmd)}` failed: {(e.stderr or '').strip()}", file=sys.stderr)
        return 3
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env={**os.environ, "GLOO_SOCKET_IFNAME": IFNAME, **env})
             for ns, cmd, env in zip(names, commands, envs)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
