"""The workbook in a real browser: JupyterLab on a free port, driven in headless Chromium.

`pytest tests/e2e` (make e2e) runs these tests alone; `make test` runs them with the rest.
They need Debian's `chromium` and the `playwright` Python package, and are skipped with the
reason when either is missing. Playwright never downloads a browser here: it drives the
system's chromium through `executable_path` (do not run `playwright install`).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from .lab_page import ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# The lab must never write the workbook's notebooks: autosave off, news and update checks off.
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
}


def pytest_configure(config):
    config.addinivalue_line("markers", "e2e: runs JupyterLab in headless Chromium (tests/e2e)")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.e2e)


def _missing() -> str:
    if CHROMIUM is None:
        return "chromium is not installed (Debian: apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install playwright)"
    return ""


@pytest.fixture(scope="package")
def lab(tmp_path_factory):
    """A JupyterLab server rooted at the repository, with a token, on a free port."""
    if _missing():
        pytest.skip(_missing())
    from ddp_lab.engine.launch import free_port
    home = tmp_path_factory.mktemp("lab")
    for name, value in SETTINGS.items():
        (home / "settings" / name).parent.mkdir(parents=True, exist_ok=True)
        (home / "settings" / name).write_text(json.dumps(value))
    lab = Lab(None, None, None, home)
    for nb in sorted((ROOT / "notebooks").rglob("*.ipynb")):  # what `make lab` trusts
        lab.trust(nb, True)
    port, token = free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}",
           "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={ROOT}", "--LabApp.expose_app_in_browser=True",
           f"--LabApp.user_settings_dir={home / 'settings'}",
           f"--LabApp.workspaces_dir={home / 'workspaces'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    # Its own data folder: the trust database is there, so what opens trusted is what this
    # fixture signed, not what `make lab` or a saved notebook once signed on this machine.
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTER_DATA_DIR": str(home / "data")}
    log = open(home / "server.log", "w")
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _get(f"{base}/api/status?token={token}") is not None, 180,
                  lambda: f"JupyterLab did not start; its log:\n{(home / 'server.log').read_text()[-3000:]}")
        lab.base, lab.token, lab.server = base, token, server
        yield lab
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


class Lab:
    def __init__(self, base, token, server, home):
        self.base, self.token, self.server, self.home = base, token, server, home

    def trust(self, notebook, trusted: bool) -> None:
        """Sign or unsign a notebook in this lab's own trust database (as `jupyter trust` does);
        the server reads it each time a notebook opens."""
        import nbformat
        from nbformat.sign import NotebookNotary
        (self.home / "data").mkdir(exist_ok=True)
        notary = NotebookNotary(data_dir=str(self.home / "data"))
        nb = nbformat.read(notebook, as_version=4)
        notary.sign(nb) if trusted else notary.unsign(nb)

    def url(self, path: str) -> str:
        """A workspace of its own for each page: nothing that an earlier page opened reopens."""
        return f"{self.base}/lab/workspaces/e2e-{secrets.token_hex(4)}/tree/{path}?reset&token={self.token}"

    def shut_down_kernels(self) -> None:
        """Ends every kernel (what a learner's "Shut Down All Kernels" does)."""
        for kernel in _get(f"{self.base}/api/kernels?token={self.token}") or []:
            req = urllib.request.Request(f"{self.base}/api/kernels/{kernel['id']}?token={self.token}",
                                         method="DELETE")
            try:
                urllib.request.urlopen(req, timeout=60).close()
            except OSError:  # gone already (404), or the server is busy ending it
                pass


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read() or b"null")
    except OSError:
        return None


def _wait_for(predicate, timeout, message):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(message())


@pytest.fixture(scope="package")
def browser():
    if _missing():
        pytest.skip(_missing())
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        # --no-sandbox: CI and containers run as root, where Chromium's sandbox refuses to start
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(autouse=True)
def no_process_left_behind(request):
    """Replaces tests/conftest.py's check: the lab server lives for the whole session, but each
    test must leave no kernel, and nothing a kernel started, behind it; and save no notebook."""
    lab = request.getfixturevalue("lab") if "lab" in request.fixturenames else None
    start = len(_log(lab)) if lab else 0
    yield
    if lab is None:
        return
    server = psutil.Process(lab.server.pid)
    # again and again: a kernel whose start was still in flight when the page closed comes later
    _wait_for(lambda: lab.shut_down_kernels() or not server.children(recursive=True), 60,
              lambda: f"left running: {[' '.join(p.cmdline())[:120] for p in server.children(recursive=True)]}")
    saved = [line for line in _log(lab)[start:].splitlines() if "Saving file at" in line]
    assert not saved, f"the browser saved a notebook: {saved}"


def _log(lab) -> str:
    return (lab.home / "server.log").read_text(errors="replace")
