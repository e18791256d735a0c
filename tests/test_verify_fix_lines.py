"""A finding's fix quotes the script's own line when it points at code: the rank condition the
script really has (`if dist.get_rank() != 0:` before an early return, `if rank == 0:` around a
call), never a condition it does not have. First on source files written here, then one verify of
tests/verify_scripts/bad_rank_return.py, which steps its LR scheduler past an early return on every
rank but 0."""
import argparse
import json
from pathlib import Path

from ddp_lab.verify.gates import quoted, rank_gate

SCRIPT = Path(__file__).parent / "verify_scripts" / "bad_rank_return.py"


def test_the_rank_condition_that_keeps_work_from_the_other_ranks_is_found(tmp_path):
    prog = tmp_path / "train.py"
    prog.write_text("import torch.distributed as dist\n"
                    "if dist.get_rank() == 0:\n"
                    "    print('hello')  # logging alone: not a gate\n"
                    "def end(sched):\n"
                    "    if not dist.get_rank() == 0:  # the other ranks leave\n"
                    "        return\n"
                    "    sched.step()\n")
    assert rank_gate(str(prog), prefer={"step"}) == (5, "if not dist.get_rank() == 0:")
    assert quoted(f"{prog}:12", prefer={"step"}) == "train.py:5 `if not dist.get_rank() == 0:`"
    prog.write_text("import torch\nfor x in data:\n    if is_main:\n        torch.save(model, 'm.pt')\n")
    assert rank_gate(str(prog)) is None and quoted(f"{prog}:2") is None  # saving alone is rank 0's job
    assert quoted(None) is None and quoted(f"{tmp_path / 'gone.py'}:3") is None


def test_the_fix_quotes_the_scripts_early_return_not_an_if_rank_0_it_does_not_have():
    from ddp_lab.verify import command
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--steps", "3", "--pg-timeout", "60", "--timeout", "300", "--", str(SCRIPT)])
    report = command.report_for(args)
    data, text = json.loads(json.dumps(report.to_dict())), report.text()
    (f,) = [f for f in data["findings"] if f["category"] == "replica-divergence"]
    line = next(i for i, x in enumerate(SCRIPT.read_text().splitlines(), 1) if "!= 0:" in x)
    assert f"bad_rank_return.py:{line} `if dist.get_rank() != 0:`" in f["fix"], text
    assert "if rank == 0" not in text
