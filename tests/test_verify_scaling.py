"""verify --scaling compares like with like: rank 0's own gradient of step 1 and the 1-rank run's,
both as backward() left them, before clipping. A clip that fires at step 1 shrinks the gradient the
optimizer sees, on 1 rank and on 2 alike; it is no scaling bug. A loss multiplied by the world size
still is, clipped or not (tests/verify_scripts/clipped.py, with and without --times-world)."""
import argparse
import json
from pathlib import Path

import pytest

from ddp_lab.verify.world import compare

SCRIPT = Path(__file__).parent / "verify_scripts" / "clipped.py"


def step1(local, grad):
    return {"kind": "step", "step": 1, "rounds": 1, "lr": [0.1], "pre_params": "p", "batch": "b",
            "grad_local": local, "grad": grad, "round_lines": ["train.py:31"]}


def test_the_1_rank_gradient_before_clipping_is_the_reference():
    # 2 ranks: rank 0's own gradient 3.0 before the all-reduce; the 1-rank run's is 3.0 before
    # clipping and 0.01 after it
    found, notes, said = compare(step1({"w": 3.0, "b": 0.5}, {"w": 0.0099, "b": 0.0017}),
                                 step1({"w": 3.0, "b": 0.5}, {"w": 0.0099, "b": 0.0017}), world=2)
    assert found == [] and notes == []
    assert any("ratio 1.0000" in s for s in said), said
    found, _, _ = compare(step1({"w": 6.0, "b": 1.0}, {}), step1({"w": 3.0, "b": 0.5}, {"w": 0.0099}), world=2)
    assert [f.category for f in found] == ["grad-scale"] and "2 times (the world size)" in found[0].message


def verify(*script_args):
    from ddp_lab.verify import command
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--steps", "2", "--scaling", "--pg-timeout", "60", "--timeout", "300", "--",
                              str(SCRIPT), *script_args])
    report = command.report_for(args)
    return json.loads(json.dumps(report.to_dict())), report.text()


@pytest.mark.parametrize("script_args, scaled", [((), False), (("--times-world",), True)])
def test_clipping_at_step_1_is_no_scaling_finding_a_loss_times_the_world_size_is(script_args, scaled):
    report, text = verify(*script_args)
    assert [(r["ranks"], r["steps"]) for r in report["runs"]] == [(2, 2), (1, 1)], text
    found = [f for f in report["findings"] if f["category"] == "grad-scale"]
    if scaled:
        assert len(found) == 1 and "2 times (the world size)" in found[0]["message"], text
        assert "drop the factor of the world size" in found[0]["fix"]
    else:
        assert found == [] and report["findings"] == [], text
        assert any(c.startswith("grad-scale: rank 0's gradient of step 1") for c in report["checked"]), text
