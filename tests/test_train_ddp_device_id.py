"""Every rung and ddp_lab.engine.runtime bind NCCL to the process's GPU at init: device_id on CUDA, none on CPU.

Without device_id, torch's barrier() warns on every NCCL run that it is guessing the device, the very
warning notebook 07 teaches as the symptom of a missing set_device.
"""
import ast
import importlib.util
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ddp_lab.lessons import ladder
from ddp_lab.engine import runtime

SOURCES = [ladder.path(r) for r in ladder.RUNGS] + [ladder.SCRIPTS.parent / "ddp_lab" / "engine" / "runtime.py"]


def load(path):
    spec = importlib.util.spec_from_file_location(f"rung_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_init_process_group_call_passes_device_id(path):
    calls = [n for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "init_process_group"]
    assert calls, path
    assert all("device_id" in {k.arg for k in c.keywords} for c in calls), path.name


class Captured(Exception):
    pass


def fake_world(monkeypatch, gpus):
    """A world of one that stops at init_process_group, with `gpus` fake CUDA devices."""
    seen = {}

    def init(*args, **kwargs):
        seen.update(kwargs, set_device=calls[:])
        raise Captured

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: calls[-1] if calls else 0)
    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DDP_LAB_BACKEND"):
        monkeypatch.delenv(k, raising=False)
    return seen


def call_setup(path):
    if path.name == "runtime.py":
        return runtime.setup()
    module = load(path)
    args = SimpleNamespace(device="auto", backend="auto", timeout=30.0)
    return module.setup(args) if module.setup.__code__.co_argcount else module.setup()


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_cuda_binds_the_gpu_after_set_device_and_cpu_binds_none(path, monkeypatch):
    seen = fake_world(monkeypatch, gpus=1)
    with pytest.raises(Captured):
        call_setup(path)
    assert seen["device_id"] == torch.device("cuda", 0) and seen["set_device"] == [0]
    seen = fake_world(monkeypatch, gpus=0)
    with pytest.raises(Captured):
        call_setup(path)
    assert seen.get("device_id") is None and seen["set_device"] == []
