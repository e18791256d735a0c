"""06.5: a save that a crash cannot tear; graded in the kernel.

The answer saves step 1, then saves step 2 while torch.save dies halfway through its write
(the grader replaces it for that call: it writes a few bytes and raises, as a killed process
would leave them), then saves step 3. The file must load step 1 after the crash and step 3
at the end, with no temporary file left after a save that finished. A power loss is not
simulated; instead the grader watches os.fsync and os.replace/os.rename: each finished save
must fsync the file it then renames, before the rename (or the name can point at bytes still
in the page cache).
"""
import os

from ddp_lab.grade.core import Exercise, register


class Killed(RuntimeError):
    """What the grader's torch.save raises halfway through the write."""


def on_rank(answer, rank, world):
    import shutil
    import tempfile
    import torch
    folder = tempfile.mkdtemp(prefix="ddp_lab_grade_")
    path = os.path.join(folder, "last.pt")
    real_save, written = torch.save, []
    real = {name: getattr(os, name) for name in ("fsync", "fdatasync", "replace", "rename") if hasattr(os, name)}
    events = []   # per answer call: ("sync", inode) and ("rename", inode of the source)

    def synced(name):
        def call(fd):
            number = fd if isinstance(fd, int) else fd.fileno()
            events[-1].append(("sync", os.fstat(number).st_ino))
            return real[name](fd)
        return call

    def renamed(name):
        def call(src, dst, *args, **kwargs):
            try:
                events[-1].append(("rename", os.stat(src).st_ino))
            except OSError:
                pass
            return real[name](src, dst, *args, **kwargs)
        return call

    def torn(obj, f, *args, **kwargs):
        written.append(os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else None)
        if written[-1] is None:
            f.write(b"PK\x03\x04torn")
        else:
            with open(f, "wb") as fh:
                fh.write(b"PK\x03\x04torn")
        raise Killed("torch.save died halfway through its write")

    def step(p):
        try:
            return torch.load(p, weights_only=True)["step"]
        except Exception as exc:
            return f"{type(exc).__name__}"

    def save(obj):
        events.append([])
        answer(obj, path)

    try:
        for name in real:
            setattr(os, name, (synced if "sync" in name else renamed)(name))
        save({"step": 1})
        after_first = sorted(os.listdir(folder))
        torch.save = torn
        try:
            save({"step": 2})
            crashed = False
        except Killed:
            crashed = True
        finally:
            torch.save = real_save
        after_crash = step(path)
        save({"step": 3})
        finished = (events[0], events[-1])
        unsynced = sum(1 for calls in finished for i, (kind, ino) in enumerate(calls)
                       if kind == "rename" and ("sync", ino) not in calls[:i])
        return {"unsynced": unsynced, "first": after_first, "crashed": crashed, "after_crash": after_crash,
                "final": step(path), "left": sorted(set(os.listdir(folder)) - {"last.pt"}),
                "torn_at": written, "folder": os.path.abspath(folder)}
    finally:
        torch.save = real_save
        for name, function in real.items():
            setattr(os, name, function)
        shutil.rmtree(folder, ignore_errors=True)


def judge(per_rank):
    o = per_rank[0]
    problems = []
    if o["first"] != ["last.pt"]:
        problems.append(f"after the first save the folder holds {o['first']}, expected only last.pt: "
                        f"save to the path you are given, and leave no temporary file behind")
    if not o["crashed"]:
        problems.append("the save that died halfway did not raise: let the error through, so the caller "
                        "knows that the new checkpoint was not written")
    if o["after_crash"] != 1:
        problems.append(f"after a save that died halfway, last.pt loads as {o['after_crash']!r} instead of "
                        f"step 1: write to a temporary file first, then os.replace() it over the old one")
    torn_at = [p for p in o["torn_at"] if p]
    if torn_at and os.path.dirname(torn_at[0]) != o["folder"]:
        problems.append(f"the temporary file was written in {os.path.dirname(torn_at[0])}, not beside the "
                        f"checkpoint: os.replace() is atomic only within one file system, so put it in "
                        f"the same folder")
    if o["final"] != 3:
        problems.append(f"the last save loads as {o['final']!r}, not step 3: the new file must replace the old")
    if o["left"]:
        problems.append(f"files left in the folder after a save that finished: {o['left']}: remove the "
                        f"temporary file (os.replace moves it, a copy does not)")
    if o.get("unsynced"):
        problems.append("the temporary file is renamed without os.fsync() first: after a power loss the new "
                        "name can point at bytes that never reached the disk; flush the file and call "
                        "os.fsync(f.fileno()) before os.replace()")
    return problems


register(Exercise(
    id="06.5", notebook="06_checkpointing", title="A save a crash cannot tear",
    skills="atomic write: temporary file in the same folder, fsync it, then os.replace; the old "
           "checkpoint survives a crash",
    answer="save_atomic(obj, path): after it, path holds obj or, if it died, the previous file",
    nproc=0, on_rank=on_rank, judge=judge))
