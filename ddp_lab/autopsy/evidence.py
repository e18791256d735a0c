"""What each rank left behind, read from a folder, as one RankEvidence per rank.

Understood, in any folder (searched recursively):
- Flight Recorder dumps: pickled (or JSON) dicts with "entries", one file per rank, its name
  ending in the rank: `fr_trace_rank_3` (ddp_lab.engine.launch), `nccl_trace_rank_3`
  (TORCH_FR_DUMP_TEMP_FILE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE), anything `<prefix><rank>`;
- what the launcher's injection wrote (ddp_lab/autopsy/_inject): rank{R}.request.json (a live
  stack), rank{R}.exception.json (the traceback a rank died with), rank{R}.exit.json (it
  finished), rank{R}.sigusr1.txt / .sigterm.txt / .fatal.txt (stacks faulthandler wrote);
- torchrun's @record error files (error.json in a folder named after the local rank, or a
  name holding the rank): the exception and its traceback.
Nothing here imports torch: the pickles hold plain Python objects.
"""
from __future__ import annotations

import json
import linecache
import os
import pickle
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

# Frames in these places are the machinery, not the program: the "where" of a rank is the
# innermost frame outside them.
_LIBRARY = re.compile(r"[/\\](site-packages|dist-packages)[/\\]|^<frozen |[/\\]ddp_lab[/\\](autopsy|verify)[/\\]")
_STDLIB = {os.path.normcase(p) for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}}
# A main thread whose innermost frames are here is blocked in a collective (autograd: DDP's
# gradient all-reduce finishes at the end of backward()).
_COLLECTIVE_FILES = re.compile(r"torch[/\\](distributed|autograd)[/\\]|torch[/\\]_tensor\.py$")
_SECONDARY = re.compile(r"Connection (reset|closed|refused)|Read error|Write error|timed out|Timed out|"
                        r"Timeout|DistBackendError|DistNetworkError|Broken pipe|NCCL", re.I)
_INJECT = re.compile(r"[/\\]ddp_lab[/\\]autopsy[/\\]_inject[/\\]")
_FH_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$')
_TB_FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)$')


@dataclass
class Frame:
    file: str
    line: int
    name: str

    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "name": self.name}


@dataclass
class Collective:
    seq: int
    op: str
    sizes: list
    pg: str
    site: Frame | None  # the program's line that called it
    frames: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"seq": self.seq, "op": self.op, "sizes": self.sizes, "pg": self.pg,
                "site": self.site.to_dict() if self.site else None}


@dataclass
class RankEvidence:
    rank: int
    collectives: list = field(default_factory=list)  # Flight Recorder entries, oldest first
    stack: list = field(default_factory=list)          # main thread, outermost first
    stack_from: str | None = None   # "live", "exception", "faulthandler", "error file"
    stack_file: str | None = None   # the file the stack was read from
    exception: str | None = None    # "Type: message" when the rank died of one
    finished: bool = False          # it ran to the end of the program
    loaders: dict = field(default_factory=dict)  # {local name: batches} of the program frames' data loaders
    files: list = field(default_factory=list)

    @property
    def known(self) -> bool:
        return bool(self.collectives or self.stack or self.finished)


def is_library(path: str) -> bool:
    if _LIBRARY.search(path):
        return True
    p = os.path.normcase(os.path.abspath(path)) if os.path.isabs(path) else path
    return any(p.startswith(s + os.sep) for s in _STDLIB)


def user_frame(frames: list) -> Frame | None:
    """The innermost frame of the program itself (frames outermost first)."""
    for f in reversed(frames):
        if not is_library(f.file):
            return f
    return frames[-1] if frames else None


def in_collective(frames: list) -> bool:
    """The innermost frames are torch's collective (or backward) machinery. Tearing the group
    down (`destroy_process_group`) is not waiting for a peer: such a rank is elsewhere."""
    lib = []
    for f in reversed(frames):
        if not is_library(f.file):
            break
        lib.append(f)
    if any(f.name == "destroy_process_group" for f in lib):
        return False
    return any(_COLLECTIVE_FILES.search(f.file) for f in lib)


def read_folder(folder) -> dict[int, RankEvidence]:
    """{rank: RankEvidence} for every rank that left anything readable in `folder`."""
    folder = Path(folder)
    ranks: dict[int, RankEvidence] = {}

    def ev(r: int) -> RankEvidence:
        return ranks.setdefault(r, RankEvidence(r))

    dumps: dict[int, dict] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.name
        try:
            if m := re.fullmatch(r"rank(\d+)\.(request|exception|exit)\.json", name):
                dumps.setdefault(int(m.group(1)), {})[m.group(2)] = (path, json.loads(path.read_text()))
            elif m := re.fullmatch(r"rank(\d+)\.(sigusr1|sigterm|fatal)\.txt", name):
                frames = parse_faulthandler(path.read_text(errors="replace"))
                found = dumps.setdefault(int(m.group(1)), {})
                old = found.get("faulthandler")
                if frames and (old is None or path.stat().st_mtime >= old[0].stat().st_mtime):
                    found["faulthandler"] = (path, frames)
            elif name.endswith(".json") and "error" in name:
                _read_error_file(path, ev)
            elif (m := re.search(r"(\d+)$", name)) and not name.endswith((".pid", ".ctl")):
                fr = _load_fr(path)
                if fr is not None:
                    e = ev(int(m.group(1)))
                    e.collectives = fr
                    e.files.append(str(path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # one unreadable file is one rank less, never a failed autopsy
    for r, found in dumps.items():
        e = ev(r)
        e.files.extend(str(p) for p, _ in found.values())
        # A rank asked while printing its traceback put it in its answer (request.json): it
        # may have been stopped before it wrote exception.json.
        died = next((found[k][1]["exception"] for k in ("exception", "request")
                     if k in found and found[k][1].get("exception")), None)
        if died:
            info = died
            e.stack_file = str(next(found[k][0] for k in ("exception", "request")
                                    if k in found and found[k][1].get("exception")))
            e.stack = [Frame(f["file"], f["line"], f["name"]) for f in info["frames"]]
            e.stack_from = "exception"
            e.loaders = _loaders(info["frames"])
            e.exception = f"{info['type']}: {info['message']}".strip()
        elif "request" in found and _main_frames(found["request"][1]):
            e.stack, e.stack_from = _main_frames(found["request"][1]), "live"
            e.loaders = _loaders(_main_thread(found["request"][1]).get("frames") or [])
            e.stack_file = str(found["request"][0])
        elif "faulthandler" in found:
            e.stack, e.stack_from = found["faulthandler"][1], "faulthandler"
            e.stack_file = str(found["faulthandler"][0])
        elif "exit" in found:
            e.finished = True
    return ranks


def _main_thread(dump: dict) -> dict:
    threads = dump.get("threads") or []
    return next((t for t in threads if t.get("main")), None) or next(
        (t for t in threads if t.get("name") == "MainThread"), None) or {}


def _main_frames(dump: dict) -> list:
    main = _main_thread(dump)
    return _before_us([Frame(f["file"], f["line"], f["name"]) for f in main.get("frames") or []])


def _loaders(frames: list) -> dict:
    """{local name: batches} of the data loaders the frames hold; an inner frame's name wins."""
    out = {}
    for f in frames:
        for name, n in (f.get("loaders") or {}).items():
            if isinstance(n, int):
                out[str(name)] = n
    return out


def _before_us(frames: list) -> list:
    """The stack up to the autopsy's own code or an excepthook (torch wraps sys.excepthook): a
    rank dumping itself as it dies is not waiting where those frames are."""
    ours = next((i for i, f in enumerate(frames) if _INJECT.search(f.file) or f.name.endswith("excepthook")), None)
    return frames if ours is None else frames[:ours]


def _load_fr(path: Path) -> list | None:
    raw = path.read_bytes()
    if raw[:1] == b"{":
        data = json.loads(raw)
    elif raw[:1] == b"\x80":
        data = pickle.loads(raw)  # a Flight Recorder dump: plain dicts, lists and strings
    else:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        return None
    out = []
    for e in data["entries"]:
        if e.get("is_p2p") or e.get("collective_seq_id") is None:
            continue
        frames = [Frame(f.get("filename", "?"), int(f.get("line", 0)), f.get("name", "?"))
                  for f in reversed(e.get("frames") or [])]  # FR lists innermost first
        op = str(e.get("profiling_name", "?")).split(":", 1)[-1]
        pg = e.get("process_group")
        out.append(Collective(int(e["collective_seq_id"]), op, e.get("input_sizes") or [],
                              str(pg[1] if isinstance(pg, (list, tuple)) else e.get("pg_id", "")),
                              user_frame(frames), frames))
    return out


def parse_faulthandler(text: str) -> list:
    """The main thread's frames (outermost first) from a faulthandler dump.

    The main thread is the one threading did not start: its outermost frame is the program's,
    not threading's _bootstrap."""
    blocks, current = [], None
    for line in text.splitlines():
        if _FH_HEADER.match(line):
            current = []
            blocks.append(current)
        elif current is not None and (m := _FH_FRAME.match(line)):
            current.append(Frame(m.group(1), int(m.group(2)), m.group(3).strip()))
    for b in reversed(blocks):
        if b and b[-1].name != "_bootstrap":
            return _before_us(b[::-1])
    return []


def _read_error_file(path: Path, ev) -> None:
    data = json.loads(path.read_text())
    msg = data.get("message")
    if not isinstance(msg, dict):
        return
    digits = re.findall(r"\d+", path.stem) or ([path.parent.name] if path.parent.name.isdigit() else [])
    if not digits:
        return
    e = ev(int(digits[-1]))
    if e.stack_from in ("live", "exception"):
        return
    stack = (msg.get("extraInfo") or {}).get("py_callstack", "")
    frames = [Frame(m.group(1), int(m.group(2)), m.group(3).strip())
              for m in map(_TB_FRAME.match, stack.splitlines()) if m]
    e.stack, e.stack_from, e.exception = frames, "error file", str(msg.get("message", ""))[:2000]
    e.stack_file = str(path)
    e.files.append(str(path))


def is_secondary(exception: str | None) -> bool:
    return bool(exception and _SECONDARY.search(exception))


def tracebacks_text(ranks: dict) -> str:
    """Every rank's whole stack, as Python prints a traceback (with the source lines), its error,
    and its Flight Recorder entries: what the diagnosis shortens to a few frames per rank."""
    out = []
    for r, e in sorted(ranks.items()):
        out.append(f"=== rank {r}: " + (f"stack from {e.stack_from} ({e.stack_file})" if e.stack else
                                        "finished the program" if e.finished else "no stack"))
        if e.stack:
            out.append("Traceback (most recent call last):")
            for f in e.stack:
                out.append(f'  File "{f.file}", line {f.line}, in {f.name}')
                if code := linecache.getline(f.file, f.line).strip():
                    out.append(f"    {code}")
        if e.exception:
            out.append(e.exception)
        if e.loaders:
            out.append("Data loaders: " + ", ".join(f"{k} {v} batches" for k, v in sorted(e.loaders.items())))
        if e.collectives:
            out.append("Flight Recorder entries (oldest first):")
            out.extend(f"  #{c.seq} {c.op} {c.sizes}" + (f" at {c.site.short()}" if c.site else "")
                       for c in e.collectives)
        out.append("")
    return "\n".join(out)
