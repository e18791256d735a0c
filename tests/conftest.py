import ipaddress
import os
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).parent
PROGRAMS = HERE / "programs"
GRADES_ENV = "DDP_LAB_GRADES"  # ddp_lab.grade.store.GRADES_ENV


def pytest_configure(config):
    """The whole session's verdicts (solution notebooks under nbval, graders in tests, the kernels and
    processes they start) go to a scratch grades file, never the learner's ~/.ddp_lab/grades.json or
    the file their own DDP_LAB_GRADES names. Set here, before any kernel starts; a test may still
    point it elsewhere with monkeypatch."""
    import tempfile
    folder = tempfile.mkdtemp(prefix="ddp_lab_test_grades_")
    config._ddp_lab_grades = (folder, os.environ.get(GRADES_ENV))
    os.environ[GRADES_ENV] = os.path.join(folder, "grades.json")
    # torchrun started directly (not through ddp_lab.launch, which gives each launch its own folder)
    # keeps its per-rank logs in a torchelastic_* folder of the temp dir that it never removes: the
    # session's torchruns keep theirs here instead, removed with the folder. A test may unset it.
    config._ddp_lab_pet_log_dir = os.environ.get("PET_LOG_DIR")
    if config._ddp_lab_pet_log_dir is None:
        os.environ["PET_LOG_DIR"] = os.path.join(folder, "torchelastic")


def pytest_unconfigure(config):
    import shutil
    folder, before = getattr(config, "_ddp_lab_grades", (None, None))
    if folder is None:
        return
    shutil.rmtree(folder, ignore_errors=True)
    if getattr(config, "_ddp_lab_pet_log_dir", None) is None:
        os.environ.pop("PET_LOG_DIR", None)
    if before is None:
        os.environ.pop(GRADES_ENV, None)
    else:
        os.environ[GRADES_ENV] = before


@pytest.fixture
def marker(tmp_path):
    """A unique string placed on worker command lines, to find every process of one launch."""
    return str(tmp_path / f"marker-{uuid.uuid4().hex[:12]}")


def processes_with(marker: str) -> list:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != os.getpid() and marker in " ".join(p.info["cmdline"] or []):
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
        except psutil.Error:
            pass
    return found


def wait_until(predicate, timeout: float, step: float = 0.2) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Every test must leave no child process of the test runner behind (launch hygiene)."""
    yield
    me = psutil.Process()
    gone = wait_until(lambda: not [p for p in me.children(recursive=True) if _running(p)], timeout=15)
    left = [p for p in me.children(recursive=True) if _running(p)]
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    assert gone, f"processes left running after the test: {[(p.pid, _cmd(p)) for p in left]}"


def _running(p) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def alive(pid: int) -> bool:
    """Whether process pid runs (a zombie or a gone pid does not)."""
    try:
        return _running(psutil.Process(pid))
    except psutil.Error:
        return False


def _cmd(p) -> str:
    try:
        return " ".join(p.cmdline())[:160]
    except psutil.Error:
        return "?"


def widget_makers() -> set:
    """Names of ddp_lab functions whose body imports ipywidgets: the workbook's widgets."""
    import ast
    names = set()
    for path in (HERE.parent / "ddp_lab").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(n, (ast.Import, ast.ImportFrom)) and "ipywidgets" in ast.dump(n)
                    for n in ast.walk(node)):
                names.add(node.name)
    return names


def widget_cells() -> list:
    """(notebook path relative to the repository, cell index) of every lesson cell that calls a
    widget maker."""
    import json
    import re
    call = re.compile(r"\.(%s)\(" % "|".join(sorted(widget_makers())))
    found = []
    for nb in sorted((HERE.parent / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        for i, c in enumerate(cells):
            if c["cell_type"] == "code" and call.search("".join(c["source"])):
                found.append((nb.relative_to(HERE.parent).as_posix(), i))
    return found


# --- listening sockets (tests/test_private_ports.py, tests/test_interactive.py) ----------
def listening(net: str) -> dict[int, tuple]:
    """Listening TCP sockets of a network namespace: {inode: (address, port)}, from NET/tcp and
    NET/tcp6 (/proc/net: this process's namespace; /proc/PID/net: that process's)."""
    found = {}
    for name, size in (("tcp", 4), ("tcp6", 16)):
        path = Path(net) / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            addr_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(addr_hex)  # 32-bit words, each in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
            found[int(fields[9])] = (ipaddress.ip_address(raw), int(port_hex, 16))
    return found


def loopback(addr) -> bool:
    return addr.is_loopback or bool(getattr(addr, "ipv4_mapped", None) and addr.ipv4_mapped.is_loopback)


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:  # the process ended, or the fd closed, while we looked
        pass
    return inodes
