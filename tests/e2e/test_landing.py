"""`make lab` as a learner starts it: plain /lab (a bookmark) lands on notebook 00, not the Launcher.

The server is the Makefile's own `lab` recipe (without reinstalling), with Jupyter's config, data
and runtime folders moved to a temporary home: the lab must need nothing from them, and write
nothing there.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys

import psutil
import pytest

from conftest import wait_until  # tests/conftest.py

from .conftest import SETTINGS, Lab, _get
from .lab_page import ROOT

NOTEBOOK_00 = "notebooks/00_first_launch.ipynb"
WORKSPACE = ROOT / ".jupyter-lab" / "default-37a8.jupyterlab-workspace"


@contextlib.contextmanager
def lab_from_make(target: str, workspaces_var: str, tmp_path):
    """The Makefile's `target` (lab, lab-zh) on a free port, without reinstalling, its workspaces in
    tmp_path/workspaces and Jupyter's folders in tmp_path; yields (base URL, token). Afterwards every
    process it started has ended."""
    from ddp_lab.engine.launch import free_port
    for name, value in SETTINGS.items():  # autosave off: the test must not write the notebook
        (tmp_path / "settings" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "settings" / name).write_text(json.dumps(value))
    port, token = free_port(), secrets.token_hex(16)
    args = [f"--port={port}", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
            "--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={tmp_path / 'settings'}"]
    venv = sys.prefix  # the environment running the tests (make's .venv in CI)
    cmd = ["make", "--no-print-directory", "-o", f"{venv}/.installed", target, f"VENV={venv}",
           f"{workspaces_var}={tmp_path / 'workspaces'}", f"LAB_ARGS={shlex.join(args)}"]
    env = {**os.environ, **{f"JUPYTER_{d}_DIR": str(tmp_path / d.lower()) for d in ("CONFIG", "DATA", "RUNTIME")}}
    log = open(tmp_path / "lab.log", "w")
    make = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        up = wait_until(lambda: make.poll() is not None or _get(f"{base}/api/status?token={token}") is not None, 180)
        assert up and make.poll() is None, f"make {target} did not start:\n{(tmp_path / 'lab.log').read_text()[-3000:]}"
        yield base, token
    finally:
        family = [psutil.Process(make.pid), *psutil.Process(make.pid).children(recursive=True)] \
            if make.poll() is None else []
        if make.poll() is None:  # "Shut Down All Kernels" first: a server stopped mid-start of one hangs
            Lab(base, token, None, tmp_path).shut_down_kernels()
            wait_until(lambda: not _get(f"{base}/api/kernels?token={token}"), 60)
        os.killpg(make.pid, signal.SIGTERM)  # the whole group, as a terminal's Ctrl-C signals it
        try:
            make.wait(timeout=60)
        finally:
            log.close()
        assert wait_until(lambda: not [p for p in family if _alive(p)], timeout=60), f"left running: {family}"


@pytest.fixture
def make_lab(tmp_path):
    """`make lab` on a free port; yields (base URL, token, the lab's workspaces folder, home)."""
    with lab_from_make("lab", "LAB_WORKSPACES", tmp_path) as (base, token):
        yield base, token, tmp_path / "workspaces", tmp_path


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_plain_lab_url_opens_notebook_00(make_lab, browser, tmp_path):
    shipped = WORKSPACE.read_bytes()
    base, token, workspaces, home = make_lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{base}/lab?token={token}")
        # a document once it is loaded, or the Launcher (which has no document)
        page.wait_for_function("() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                               " return w && (!w.context || w.context.isReady); }", timeout=120_000)
        page.screenshot(path=str(tmp_path / "landing.png"))
        current = page.evaluate("() => { const w = window.jupyterapp.shell.currentWidget;"
                                " return w.context ? w.context.path : w.id; }")
        main = page.evaluate("() => [...window.jupyterapp.shell.widgets('main')].map(w => w.id)")
        assert current == NOTEBOOK_00, f"/lab opened {current!r}, not notebook 00"
        # its kernel up before the server stops: a server stopped while a kernel starts hangs
        page.wait_for_function("() => { const s = window.jupyterapp.shell.currentWidget.sessionContext.session;"
                               " return s && s.kernel && s.kernel.status === 'idle'; }", timeout=180_000)
    finally:
        page.close()
    assert not [w for w in main if "launcher" in w.lower()], f"the Launcher opened beside it: {main}"
    # the lab's own workspace was made from the shipped one, which stays as it is (the lab saves
    # the learner's layout into the copy); the user's Jupyter config got no workspace of ours
    assert (workspaces / WORKSPACE.name).exists()
    assert WORKSPACE.read_bytes() == shipped
    assert not (home / "config" / "lab" / "workspaces").exists()
