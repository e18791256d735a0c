"""Arms a torchrun worker for a hang autopsy; does nothing unless DDP_LAB_AUTOPSY_DIR is set.

ddp_lab.engine.launch puts this folder first on PYTHONPATH, so Python imports this file at startup in
every process of the job, before the user's program (which stays unchanged). In a rank (RANK is
set) it writes nothing until asked, and then only into $DDP_LAB_AUTOPSY_DIR:

- rank{R}.pid         the rank is armed (its pid), so the launcher may ask it;
- rank{R}.ctl         a FIFO: writing a line to it makes a thread (blocked in open(), so it costs
                      nothing meanwhile) write rank{R}.request.json (every thread's stack; for
                      the program's frames, the length of each data loader they hold) and
                      fr_trace_rank_{R} (torch's Flight Recorder dump, as TORCH_FR_DUMP_TEMP_FILE
                      would write it), then touch rank{R}.done.{request};
- rank{R}.sigusr1.txt, .sigterm.txt, .fatal.txt: stacks faulthandler writes (no GIL needed) on
                      SIGUSR1, on SIGTERM (then the rank dies as before), on a crash (SIGABRT ...);
- on an uncaught exception: rank{R}.exception.json, with its traceback, written first with the
  exception alone and again once the hooks have run, with the stacks and the Flight Recorder;
  the first failing rank also asks the other ranks of this node to dump (torchrun stops them a
  moment later).
  A rank asked while its excepthooks still run (ours, torch's, the program's own: a log
  upload...) puts the exception in its answer, request.json: torchrun may stop it before it
  writes exception.json;
- at a normal exit: rank{R}.exit.json, the Flight Recorder only (the collectives it ran).

Every step is wrapped: a failure here leaves the program exactly as it would run without it.
An existing sitecustomize further down sys.path still runs (it is imported after this one).
"""
import os
import sys

ENV = "DDP_LAB_AUTOPSY_DIR"
_ARMED_PID = "DDP_LAB_AUTOPSY_ARMED"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain_next_sitecustomize():
    """Run the sitecustomize this file shadows, if there is one."""
    import importlib.machinery
    import importlib.util
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    if os.path.dirname(os.path.abspath(spec.origin or "")) == _HERE:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # what it would have been without us
    spec.loader.exec_module(module)


def _frames(frame, loaders=False):
    """[{file, line, name}], outermost first; loaders: with each program frame's data loaders."""
    out = []
    while frame is not None:
        out.append(_frame(frame, frame.f_lineno, loaders))
        frame = frame.f_back
    return out[::-1]


def _frame(frame, line, loaders):
    out = {"file": frame.f_code.co_filename, "line": line, "name": frame.f_code.co_name}
    if loaders and not _machinery(out["file"]):
        found = _loaders(frame)
        if found:
            out["loaders"] = found
    return out


_MACHINERY = []  # folders whose frames are not the program's: the standard library, installed packages


def _machinery(path):
    if not _MACHINERY:
        import sysconfig
        _MACHINERY.extend(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib"))
        _MACHINERY.append(_HERE)
    return path.startswith("<") or path.startswith(tuple(_MACHINERY))


def _loaders(frame):
    """{local name: batches} of a program frame's data loaders: a DataLoader over a map-style data
    set (len() is its sampler's length: no data is touched), or a list or tuple in a local whose name
    says loader or batches. Whether the ranks had as many batches tells a rank whose data ran out
    from one that left its loop early."""
    out = {}
    try:
        items = list(frame.f_locals.items())
    except Exception:  # noqa: BLE001
        return out
    for name, value in items:
        try:
            kinds = {c.__name__ for c in type(value).__mro__}
            if "DataLoader" in kinds:
                if "IterableDataset" not in {c.__name__ for c in type(value.dataset).__mro__}:
                    out[name] = len(value)
            elif isinstance(value, (list, tuple)) and ("loader" in name.lower() or "batches" in name.lower()):
                out[name] = len(value)
        except Exception:  # noqa: BLE001 - a loader that cannot say its length is left out
            continue
    return out


def _alive(pid_file):
    try:
        with open(pid_file) as f:
            os.kill(int(f.read()), 0)
        return True
    except (OSError, ValueError):
        return False


class _Arm:
    def __init__(self, folder, rank):
        self.folder, self.rank = folder, rank
        self.base = os.path.join(folder, f"rank{rank}")
        self.fr_path = os.path.join(folder, f"fr_trace_rank_{rank}")
        self.main_ident = None
        self.exc = None  # (type, value, traceback) once our excepthook has it

    def path(self, suffix):
        return f"{self.base}.{suffix}"

    def write(self, path, data: bytes):
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def flight_recorder(self):
        """Write torch's Flight Recorder dump; return its file name (None: torch not in use).

        Without the entries' Python frames: symbolizing them costs seconds of CPU the first time
        (3-8 s measured with torch 2.14 on 2 cores). The stack says where the rank is instead."""
        c10d = sys.modules.get("torch._C._distributed_c10d")  # never import torch ourselves
        if c10d is None or not hasattr(c10d, "_dump_fr_trace"):
            return None
        self.write(self.fr_path, c10d._dump_fr_trace(includeStackTraces=False))
        return os.path.basename(self.fr_path)

    def dying(self, main_frame):
        """(type, value, traceback) the main thread is dying of while an excepthook runs, or None.

        Python sets sys.last_value before it calls sys.excepthook, and the hooks' frames are then
        the main thread's whole stack (no module frame, no `python -m` runner below them)."""
        if self.exc is not None:
            return self.exc
        value = getattr(sys, "last_value", None)
        if value is None or main_frame is None:
            return None
        while main_frame.f_back is not None:
            main_frame = main_frame.f_back
        if main_frame.f_code.co_name in ("<module>", "_run_module_as_main"):
            return None  # running the program: a last_value from before (IPython sets it too)
        return type(value), value, getattr(sys, "last_traceback", None)

    def dump(self, reason, request=None, exc=None, stacks=True, fr=True):
        import json
        import threading
        import time
        out = {"rank": self.rank, "pid": os.getpid(), "reason": reason, "request": request,
               "time": time.time(), "argv": sys.argv, "world_size": os.environ.get("WORLD_SIZE"),
               "threads": [], "exception": None, "fr": None, "fr_error": None}
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        try:
            current = sys._current_frames() if stacks else {}
            if request is not None and exc is None:
                exc = self.dying(current.get(self.main_ident))
            for ident, frame in current.items():
                if ident == me and request is not None:
                    continue  # this thread: always here, answering
                out["threads"].append({"ident": ident, "name": names.get(ident, "?"),
                                       "main": ident == self.main_ident,
                                       "frames": _frames(frame, loaders=ident == self.main_ident)})
        except Exception as e:  # noqa: BLE001 - a partial dump is still a dump
            out["threads_error"] = repr(e)
        if exc is not None:
            etype, value, tb = exc
            frames = []
            while tb is not None:
                frames.append(_frame(tb.tb_frame, tb.tb_lineno, loaders=True))
                tb = tb.tb_next
            out["exception"] = {"type": getattr(etype, "__name__", str(etype)),
                                "message": str(value)[:2000], "frames": frames}
        try:
            out["fr"] = self.flight_recorder() if fr else None
        except Exception as e:  # noqa: BLE001
            out["fr_error"] = repr(e)
        self.write(self.path(f"{reason}.json"), json.dumps(out).encode())
        if request is not None:
            self.write(self.path(f"done.{request}"), b"")

    def failed(self, e):
        try:
            with open(self.path("autopsy-error.txt"), "a") as f:
                f.write(f"{type(e).__name__}: {e}\n")
        except Exception:  # noqa: BLE001
            pass

    def serve(self):
        """Thread: block in open() until someone writes a request line into the FIFO."""
        ctl = self.path("ctl")
        while True:
            try:
                with open(ctl, "rb") as f:
                    lines = f.read().decode(errors="replace").split()
            except Exception:  # noqa: BLE001 - the folder went away: stop answering
                return
            for request in lines[:1]:
                try:
                    self.dump("request", request="".join(c for c in request if c.isalnum())[:32])
                except Exception as e:  # noqa: BLE001 - said in the folder, never to the program
                    self.failed(e)

    def poke_peers(self):
        """Ask every other armed rank in the folder to dump now; wait a little for the answers."""
        import time
        try:
            fd = os.open(os.path.join(self.folder, "peers-asked"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.close(fd)
        except OSError:
            return  # another rank asked already (or the folder is gone)
        asked = []
        for name in os.listdir(self.folder):
            if name.startswith("rank") and name.endswith(".ctl") and name != f"rank{self.rank}.ctl":
                try:
                    fd = os.open(os.path.join(self.folder, name), os.O_WRONLY | os.O_NONBLOCK)
                    os.write(fd, b"peer\n")
                    os.close(fd)
                    asked.append(name[:-4])
                except OSError:
                    pass
        end = time.time() + 3.0
        while asked and time.time() < end:
            asked = [a for a in asked if not os.path.exists(os.path.join(self.folder, f"{a}.done.peer"))
                     and _alive(os.path.join(self.folder, f"{a}.pid"))]
            time.sleep(0.05)

    def arm(self):
        import faulthandler
        import signal
        import threading
        self.main_ident = threading.main_thread().ident
        # Stacks without the GIL: on request (SIGUSR1), when stopped (SIGTERM: the stack, then the
        # default action, as before) and on a crash. A program that sets its own handler wins.
        self.files = {what: open(self.path(f"{what}.txt"), "w") for what in ("sigusr1", "sigterm", "fatal")}
        faulthandler.register(signal.SIGUSR1, file=self.files["sigusr1"], all_threads=True)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            faulthandler.register(signal.SIGTERM, file=self.files["sigterm"], all_threads=True, chain=True)
        if not faulthandler.is_enabled():
            faulthandler.enable(file=self.files["fatal"], all_threads=True)
        ctl = self.path("ctl")
        if os.path.exists(ctl):
            os.unlink(ctl)  # a restarted attempt: a fresh FIFO
        os.mkfifo(ctl, 0o600)
        threading.Thread(target=self.serve, name="ddp-lab-autopsy", daemon=True).start()
        previous = sys.excepthook

        def excepthook(etype, value, tb):
            self.exc = (etype, value, tb)  # a request answered meanwhile carries it
            if not issubclass(etype, KeyboardInterrupt):
                try:  # the exception alone, at once: when another rank dies first, torchrun stops
                    # this one while the hooks below print and dump (a rank that aborts asks nobody)
                    self.dump("exception", exc=self.exc, stacks=False, fr=False)
                except Exception as e:  # noqa: BLE001
                    self.failed(e)
            try:
                previous(etype, value, tb)  # the traceback, as without the autopsy
            finally:
                try:
                    if not issubclass(etype, KeyboardInterrupt):
                        self.dump("exception", exc=(etype, value, tb))
                        self.poke_peers()  # before this rank exits and torchrun stops the others
                except Exception as e:  # noqa: BLE001
                    self.failed(e)

        sys.excepthook = excepthook

        def at_exit():  # which collectives it ran before it ended: the others may wait for more
            try:
                self.dump("exit", stacks=False)
            except Exception:  # noqa: BLE001
                pass

        import atexit
        atexit.register(at_exit)
        self.write(self.path("pid"), str(os.getpid()).encode())


def _main():
    folder, rank = os.environ.get(ENV), os.environ.get("RANK")
    if not folder or rank is None or not os.path.isdir(folder):
        return
    if os.environ.get(_ARMED_PID) not in (None, str(os.getpid())):
        return  # a child of a rank (a DataLoader worker, a subprocess): not a rank itself
    os.environ[_ARMED_PID] = str(os.getpid())
    _Arm(folder, int(rank)).arm()


try:
    _main()
except Exception:  # noqa: BLE001 - never break the program
    pass
try:
    _chain_next_sitecustomize()
finally:
    del _chain_next_sitecustomize
