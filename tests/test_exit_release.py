"""No DDP model may outlive destroy_process_group: freed at interpreter exit instead, it can abort a
rank that finished its work ("terminate called without an active exception").

The cause, seen with torch 2.14.1: torch's first optimizer lazily imports torch._dynamo, and during
that import torch.fx.wrap keeps its own frame in a local, a reference cycle that pins every frame
then on the stack, train()'s included, until the cycle collector runs. The programs release it with gc.collect()
before destroying the group. These tests turn automatic collection off, so they do not depend on
when the collector happens to run: without the release they fail every time, not one run in five.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import PROGRAMS
from ddp_lab.engine import launch

PROBE = PROGRAMS / "release_probe.py"


def probe(script, *args, no_collect=False, tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(launch.free_port()), "OMP_NUM_THREADS": "1",
           "MINIMAL_DDP_OUT": str(tmp_path / "m.pt"), "PYTHONPATH": str(launch.ROOT)}
    flags = ["--no-collect"] if no_collect else []
    proc = subprocess.run([sys.executable, PROBE, str(script), *flags, "--", *map(str, args)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RELEASE "))
    return json.loads(line[len("RELEASE "):])


PROGRAMS_UNDER_TEST = [
    (launch.script("train_ddp.py"), ["--max-steps", "2", "--epochs", "1", "--progress", "off"]),
    (launch.script("minimal_ddp.py"), []),
    (PROGRAMS / "runtime_function_model.py", []),
]


@pytest.mark.parametrize("script,args", PROGRAMS_UNDER_TEST, ids=lambda v: getattr(v, "name", ""))
def test_no_ddp_model_is_alive_when_the_group_is_destroyed(script, args, tmp_path):
    out = probe(script, *args, tmp_path=tmp_path)
    assert out["built"] >= 1
    assert out["alive_at_destroy"] == [0]


def test_the_pin_is_real_without_the_release(tmp_path):
    """The control: with gc.collect() disabled, train()'s model is still alive at destroy."""
    script, args = PROGRAMS_UNDER_TEST[0]
    out = probe(script, *args, no_collect=True, tmp_path=tmp_path)
    if out["alive_at_destroy"] == [0]:
        pytest.skip(f"torch {torch.__version__} no longer pins the frame: the scripts' gc.collect() can go")
    assert out["alive_at_destroy"] == [1]


SURVEY = PROGRAMS.parent / "check_corpus" / "articles" / "survey_3_4_train.py"
SURVEY_CPU = PROGRAMS / "survey_train_cpu.py"


def test_survey_train_destroys_the_group_while_its_ddp_model_is_alive(tmp_path):
    """The survey's train() (section 3.4) ends with cleanup() -> destroy_process_group() while its DDP
    model is still a local: the group is destroyed under a live DDP and its reducer, every run. With the
    collector off, the model then outlives train() itself (torch's frame cycle), with no group left:
    what notebook 07's deep dive on the SIGABRT at exit describes as the precondition of the exit abort."""
    import ast
    tree = ast.parse(SURVEY.read_text(encoding="utf-8"))
    funcs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    assert [ast.unparse(n) for n in funcs["cleanup"].body] == ["dist.destroy_process_group()"]
    assert ast.unparse(funcs["train"].body[-1]) == "cleanup()"
    assert not any(isinstance(n, ast.Delete) for n in ast.walk(funcs["train"]))   # model never released
    cpu = {f.name: f for f in ast.parse(SURVEY_CPU.read_text(encoding="utf-8")).body if isinstance(f, ast.FunctionDef)}
    assert ast.unparse(cpu["train"].body[-1]) == "cleanup()" and ast.unparse(cpu["cleanup"]) == ast.unparse(funcs["cleanup"])

    out = probe(SURVEY_CPU, tmp_path=tmp_path)
    assert out["built"] == 1 and out["alive_at_destroy"] == [1] and out["reducers_at_destroy"] == [1]
    assert out["group_after_return"] is False
    if out["alive_after_return"] == 0:
        pytest.skip(f"torch {torch.__version__} no longer pins train()'s frame after it returns")
    assert out["alive_after_return"] == 1 and out["alive_after_collect"] == 0


def test_survey_fixed_order_leaves_no_ddp_alive_at_destroy(tmp_path):
    """survey_3_4_train_fixed.py's order: del model, optimizer, scheduler; gc.collect(); destroy."""
    out = probe(SURVEY_CPU, "--fixed", tmp_path=tmp_path)
    assert out["built"] == 1 and out["alive_at_destroy"] == [0] and out["reducers_at_destroy"] == [0]
    assert out["alive_after_return"] == 0
