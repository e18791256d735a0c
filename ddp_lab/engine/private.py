"""Launches that listen on loopback only: each local job in a private network namespace.

    from ddp_lab.engine import private
    private.mode()        # "private network namespace (loopback only)", or the fallback and why
    private.wrap(cmd)     # cmd, run in a network namespace of its own with its own loopback

torchrun's agent serves its rendezvous store (a c10d TCPStore, no authentication) on every
interface of the machine for the whole job: on a café or workshop network anyone can read and
write the job's keys. A job on one machine needs loopback only, so every local launch runs in a
network namespace of its own (`unshare --net`; as an ordinary user in a user namespace too,
`unshare --user --map-root-user --net`), in which the only interface is a fresh loopback: what
the job listens on cannot be reached from the network, nor seen from the machine's namespace.

`unshare` without --fork and `sh -c '... exec "$@"'` exec, so the wrapped command keeps its
process id: the launcher's guardian, its timeout, interrupt and kill of the whole tree work as
before. Several processes of one job (the nodes of a multi-node launch, elastic agents) share one
namespace: Shared starts a holder there, and each process joins it with `nsenter`.

Opt-outs: network=True for a job that needs the network (a dataset download, a real multi-node
run); DDP_LAB_PRIVATE=off for every launch. Where the machine cannot (not Linux, no unshare, user
namespaces blocked), launches run as before and mode() says so.
"""
from __future__ import annotations

import functools
import os
import shlex
import shutil
import sys
import time
import weakref
# Bound here, not looked up in subprocess at each call: a caller that stands in for
# subprocess.Popen to see the processes it starts (a test) sees its own, not this module's.
from subprocess import DEVNULL, PIPE, Popen, TimeoutExpired

OFF_ENV = "DDP_LAB_PRIVATE"
PRIVATE = "private network namespace (loopback only)"
# iproute2 installs ip and tc in /usr/sbin (/sbin), which an ordinary user's PATH lacks on Debian
SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def which(tool: str) -> str | None:
    """How to run `tool`: its bare name where PATH finds it, else its full path in an sbin folder;
    None when it is in neither (then it is not installed)."""
    if shutil.which(tool):
        return tool
    return shutil.which(tool, path=os.pathsep.join(SBIN))


def with_sbin(path: str | None) -> str:
    """PATH plus the sbin folders it lacks: for children that run ip and tc by name."""
    parts = path.split(os.pathsep) if path else []
    return os.pathsep.join(parts + [d for d in SBIN if d not in parts])


def not_found(tools) -> str:
    """The tools of `tools` found neither on PATH nor in the sbin folders, as 'ip, tc'; '' if none."""
    return ", ".join(t for t in tools if which(t) is None)


LO_UP = f'{shlex.quote(which("ip") or "ip")} link set lo up && exec "$@"'  # the namespace's loopback starts down
# gloo binds where the hostname resolves; on many machines that is an address of the network,
# which a private namespace lacks (gloo then warns and falls back to loopback): name loopback.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo"}
# The namespace has no DNS: torch's store, unable to look up a peer's name (127.0.0.1 as seen by a
# dual-stack socket, ::ffff:127.0.0.1, is rarely in /etc/hosts), warns once per process. Harmless
# (it prints the address instead); the launcher keeps such lines in the log and does not show them.
NO_DNS_WARNINGS = ("[c10d] The hostname of the client socket cannot be retrieved",)
EXPOSED = "the rendezvous store (torchrun's agent) listens on every interface while a job runs"
# What a program sees when it reaches for the network from a private namespace: no route, no DNS.
NO_NETWORK = ("Network is unreachable", "Temporary failure in name resolution",
              "Name or service not known", "No address associated with hostname", "No route to host")
NO_NETWORK_HINT = ("[launch] this job ran in a private network namespace (loopback only), where nothing "
                   "outside this machine can be reached: launch it with network=True if it needs the "
                   f"network (or set {OFF_ENV}=off)")


# The same signs where the job had the machine's network: the machine itself reaches nothing.
OFFLINE_HINT = ("[launch] this job had the machine's network (as network=True gives it; a --download among "
                "its arguments implies it) and could not reach what it asked for: if this machine has no network, "
                "download the data on one that has, copy it into the program's data folder (--data-dir), and "
                "launch without --download")
CLUSTER_HINT = ("[launch] the nodes of the localhost cluster (link=...) reach each other only, never the network: "
                "download first in a launch without link= (it keeps the machine's network: network=True, which "
                "--download implies), then launch the cluster without --download")


def no_network_hint(log: str) -> str:
    """NO_NETWORK_HINT if the job's output shows it reached for the network and found none; else ''."""
    return NO_NETWORK_HINT if any(sign in log for sign in NO_NETWORK) else ""


def _off() -> str | None:
    value = os.environ.get(OFF_ENV, "")
    return value if value.lower() in ("0", "off", "no", "false") else None


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[tuple[str, ...] | None, str]:
    """(the unshare prefix that works here, "") or (None, why not); tried once per process."""
    if not sys.platform.startswith("linux"):
        return None, "network namespaces need Linux"
    missing = not_found(("unshare", "nsenter", "ip"))
    if missing:
        return None, f"no {missing} on PATH nor in {', '.join(SBIN)} (install util-linux and iproute2)"
    unshare = which("unshare")
    tries = [(unshare, "--user", "--map-root-user", "--net")]
    if os.geteuid() == 0:  # root needs no user namespace (and keeps its real uid)
        tries.insert(0, (unshare, "--net"))
    why = "no message"
    for prefix in tries:
        try:
            p = Popen([*prefix, "--", "sh", "-c", LO_UP, "sh", "true"], stdin=DEVNULL, stdout=DEVNULL,
                      stderr=PIPE, text=True)
        except OSError as e:
            why = str(e)
            continue
        try:
            err = p.communicate(timeout=20)[1]
        except TimeoutExpired:
            p.kill()
            p.wait()
            why = "it did not end in 20 s"
            continue
        if p.returncode == 0:
            return prefix, ""
        why = (err.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
    return None, f"`unshare --user --map-root-user --net` fails here ({why}): user namespaces are blocked"


def available() -> bool:
    """Whether launches run in private network namespaces (tested once per process; the opt-out
    DDP_LAB_PRIVATE=off is read on every call)."""
    return _off() is None and _probe()[0] is not None


def mode() -> str:
    """One line: what launches use, and why."""
    if _off() is not None:
        return f"machine's network ({OFF_ENV}={os.environ[OFF_ENV]}): {EXPOSED}"
    prefix, why = _probe()
    if prefix is None:
        return f"machine's network, no private namespace ({why}): {EXPOSED}"
    return PRIVATE


def wrap(cmd, network: bool = False) -> list[str]:
    """cmd run in a private network namespace with its own loopback, or cmd as it is (network=True,
    DDP_LAB_PRIVATE=off, or not available). The wrapped command keeps cmd's process id."""
    if network or not available():
        return list(cmd)
    return [*_probe()[0], "--", "sh", "-c", LO_UP, "sh", *map(str, cmd)]


class Shared:
    """One private namespace for several processes of one job (they talk over its loopback).

    A holder (the launcher's guardian over `sleep`) keeps it; enter(cmd) joins it; close() ends
    the holder, and the namespace vanishes with the last process in it. With network=True, or
    where private namespaces are not available, enter(cmd) is cmd."""

    def __init__(self, network: bool = False, timeout: float = 30):
        self.holder = None
        if network or not available():
            return
        cmd = wrap([sys.executable, "-m", "ddp_lab.engine._reaper", str(os.getpid()), "--", "sleep", "infinity"])
        self.holder = Popen(cmd, stdin=DEVNULL, stdout=DEVNULL, stderr=PIPE)
        self._end = weakref.finalize(self, _end, self.holder)  # also when dropped without close()
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.holder.poll() is not None or time.monotonic() > deadline:
                err = self.holder.stderr.read().decode(errors="replace").strip() if self.holder.poll() is not None else ""
                self.close()
                raise RuntimeError(f"the private network namespace did not start ({err or 'timed out'}); "
                                   f"{OFF_ENV}=off launches without it")
            time.sleep(0.01)

    def _ready(self) -> bool:
        """The holder is in its namespace and past `ip link set lo up` (it exec'd the guardian)."""
        try:
            moved = os.readlink(f"/proc/{self.holder.pid}/ns/net") != os.readlink("/proc/self/ns/net")
            with open(f"/proc/{self.holder.pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            return False
        return moved and argv0 == sys.executable

    def enter(self, cmd) -> list[str]:
        if self.holder is None:
            return list(cmd)
        user = ["--user", "--preserve-credentials"] if "--user" in _probe()[0] else []
        nsenter = which("nsenter") or "nsenter"
        return [nsenter, "--target", str(self.holder.pid), *user, "--net", "--", *map(str, cmd)]

    def close(self) -> None:
        if self.holder is not None:
            self._end()


def _end(holder) -> None:
    if holder.poll() is None:
        holder.terminate()  # its guardian ends `sleep`
        try:
            holder.wait(timeout=10)
        except TimeoutExpired:
            holder.kill()
            holder.wait()
    holder.stderr.close()
