import os
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).parent
PROGRAMS = HERE / "programs"


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
