"""A tiny guardian between the notebook kernel and torchrun.

    python -m ddp_lab.engine._reaper PARENT_PID [--rm FOLDER ...] -- python -m torch.distributed.run ...

torchrun starts its workers in sessions of their own, so killing torchrun's
process group does not reach them, and a SIGKILLed agent (as when Jupyter
restarts a kernel) cleans up nothing. This process stays between the two:

- On Linux it is a *child subreaper*: workers orphaned by a dead agent are
  re-parented to it, so it can still find and kill them.
- It kills the whole tree when the kernel (PARENT_PID) disappears, when it
  receives SIGTERM/SIGINT/SIGHUP, and after the command exits (stragglers).
- When the kernel disappears, it also removes each --rm FOLDER (the launch's records and
  torchrun's logs): the kernel, which would have read and removed them, is gone.

It imports only the standard library and psutil, so it starts in milliseconds.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil


def _set_subreaper() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    PR_SET_CHILD_SUBREAPER = 36
    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    # If the kernel dies, we get SIGTERM at once instead of on the next poll.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def kill_tree(grace: float = 3.0) -> None:
    """SIGTERM every descendant, then SIGKILL what is left after `grace` seconds."""
    me = psutil.Process()
    for attempt in range(5):  # repeat: a dying agent may spawn nothing new, but be sure
        procs = me.children(recursive=True)
        if not procs:
            return
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM if attempt == 0 else signal.SIGKILL)
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=grace if attempt == 0 else 1.0)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=1.0)
        _reap_zombies()


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str]) -> int:
    parent = int(argv[0])
    options = argv[1:argv.index("--")]
    folders = [options[i + 1] for i, o in enumerate(options) if o == "--rm"]
    cmd = argv[argv.index("--") + 1:]
    _set_subreaper()
    stop = {"why": None}

    def on_signal(signum, _frame):
        stop["why"] = signal.Signals(signum).name

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    if os.getppid() != parent:  # the kernel died before we even started
        return 1
    child = subprocess.Popen(cmd)
    code = None
    while code is None:
        try:
            code = child.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if stop["why"] is None and os.getppid() != parent:  # re-parented: kernel gone
            stop["why"] = "parent gone"
        if stop["why"] is not None:
            kill_tree()
            code = child.poll()
            code = 128 + signal.SIGTERM if code is None else code
            break
    kill_tree(grace=1.0)  # orphans the agent left behind, if any
    if os.getppid() != parent:  # the kernel died (its death signal may have come as SIGTERM)
        import shutil
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
