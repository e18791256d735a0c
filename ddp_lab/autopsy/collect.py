"""The launcher's side of the autopsy: arm the ranks through the environment, ask, read.

ddp_lab.engine.launch creates one Autopsy per launch. Its env() puts ddp_lab/autopsy/_inject first on
PYTHONPATH (a sitecustomize that arms each rank: see its docstring) and turns the Flight
Recorder on; the program itself is not changed. When the job hangs, collect() asks every live
rank for its stacks and Flight Recorder entries and waits a bounded time; diagnosis() reads
the folder. Every step swallows its own failures: without an answer, the launcher says what it
said before the autopsy existed.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import tempfile
import time
from pathlib import Path

import psutil

INJECT = Path(__file__).resolve().parent / "_inject"
DIR_ENV = "DDP_LAB_AUTOPSY_DIR"
SWITCH_ENV = "DDP_LAB_AUTOPSY"  # "0" turns the autopsy off for a launch
FR_BUFFER = "2000"  # Flight Recorder entries kept per process (a ring buffer)
ASK_S, SIGNAL_S = 4.0, 1.5  # at most this long for the ranks' own answers, then faulthandler's


def start(child_env: dict) -> "Autopsy | None":
    """An Autopsy whose variables are now in child_env, or None (switched off, or it failed)."""
    if child_env.get(SWITCH_ENV, "1") == "0":
        return None
    try:
        autopsy = Autopsy()
        child_env.update(autopsy.env(child_env))
        return autopsy
    except Exception:  # noqa: BLE001 - no autopsy is today's launcher, never a failed launch
        return None


class Autopsy:
    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="ddp_lab_autopsy_"))

    def env(self, child_env: dict) -> dict:
        """Variables to add to the job's environment."""
        path = os.pathsep.join(filter(None, [str(INJECT), child_env.get("PYTHONPATH")]))
        out = {DIR_ENV: str(self.folder), "PYTHONPATH": path}
        if not child_env.get("TORCH_FR_BUFFER_SIZE") and not child_env.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
            out["TORCH_FR_BUFFER_SIZE"] = FR_BUFFER
        return out

    def armed(self, ours: set) -> dict:
        """{rank: pid} of the armed ranks still running below this launcher."""
        out = {}
        for p in self.folder.glob("rank*.pid"):
            try:
                pid = int(p.read_text())
                rank = int(p.name[4:-4])
            except (OSError, ValueError):
                continue
            if pid in ours:
                out[rank] = pid
        return out

    def collect(self, roots) -> None:
        """Ask every live rank for a dump, within ASK_S + SIGNAL_S seconds. Never raises."""
        try:
            ours = set()
            for root in roots:
                try:
                    ours |= {c.pid for c in psutil.Process(root).children(recursive=True)}
                except psutil.Error:
                    pass
            ranks = self.armed(ours)
            request = secrets.token_hex(4)
            asked = {}
            for rank, pid in ranks.items():
                try:
                    fd = os.open(self.folder / f"rank{rank}.ctl", os.O_WRONLY | os.O_NONBLOCK)
                    try:
                        os.write(fd, f"{request}\n".encode())
                    finally:
                        os.close(fd)
                    asked[rank] = pid
                except OSError:
                    pass
            end = time.monotonic() + ASK_S
            silent = dict(ranks)
            while silent and time.monotonic() < end:
                silent = {r: p for r, p in silent.items()
                          if not (self.folder / f"rank{r}.done.{request}").exists()}
                if silent:
                    time.sleep(0.05)
            # A rank whose Python cannot answer (a C extension holding the GIL): faulthandler
            # writes its stacks from the signal handler itself.
            for rank, pid in silent.items():
                try:
                    os.kill(pid, signal.SIGUSR1)
                except OSError:
                    pass
            end = time.monotonic() + (SIGNAL_S if silent else 0)
            while silent and time.monotonic() < end:
                silent = {r: p for r, p in silent.items() if not _written(self.folder / f"rank{r}.sigusr1.txt")}
                if silent:
                    time.sleep(0.05)
        except Exception:  # noqa: BLE001 - an autopsy that fails must not fail the launch
            pass

    def diagnosis(self, world_size: int | None):
        """The Diagnosis, saved in the folder as diagnosis.json and diagnosis.txt, or None. Every
        rank's whole stack goes to tracebacks.txt, which the diagnosis names."""
        try:
            from ddp_lab.autopsy.diagnose import TRACEBACKS, diagnose_folder
            from ddp_lab.autopsy.evidence import read_folder, tracebacks_text
            d = diagnose_folder(self.folder, world_size)
            if d is not None:
                (self.folder / TRACEBACKS).write_text(tracebacks_text(read_folder(self.folder)))
                d.tracebacks = str(self.folder / TRACEBACKS)
                (self.folder / "diagnosis.json").write_text(json.dumps(d.to_dict(), indent=2))
                (self.folder / "diagnosis.txt").write_text(d.message() + "\n")
            return d
        except Exception:  # noqa: BLE001
            return None

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _written(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False
