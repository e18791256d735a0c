"""The autopsy tells a rank that left the training loop early (a break, an early stop, a caught
exception) from a rank whose data ran out first (uneven inputs), and gives each its own fix.

Two launches of tests/programs/hang_loop_exit.py, whose loop is the same in both (it has a
`break`): in one, rank 1 breaks out at once; in the other, rank 0's loader has one batch more.
The ranks' process-group timeout (5 s) ends each hang. Then the source rules alone, without a launch:
a loop with no way out but its data, and an exception caught around the loop."""
import concurrent.futures

import pytest

from conftest import PROGRAMS
from ddp_lab.autopsy import patterns
from ddp_lab.autopsy.evidence import Frame
from ddp_lab.engine import launch

PROGRAM = PROGRAMS / "hang_loop_exit.py"


def line_of(code: str) -> int:
    return next(i for i, l in enumerate(PROGRAM.read_text().splitlines(), 1) if l.strip().startswith(code))


@pytest.fixture(scope="module")
def hangs():
    def one(how):
        try:
            launch.torchrun(PROGRAM, nproc=2, args=[how], stream=False, env={"HANG_PG_TIMEOUT": "5"}, timeout=240)
        except launch.LaunchError as e:
            return e
        return None

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(("early_stop", "uneven"), pool.map(one, ("early_stop", "uneven"))))


def test_a_rank_that_broke_out_of_the_loop_is_an_early_stop_not_uneven_inputs(hangs):
    e = hangs["early_stop"]
    assert e is not None and e.autopsy is not None, "the launch should have hung and been diagnosed"
    p = e.autopsy.pattern
    assert p is not None and p.name == "left_loop", str(e)
    assert p.evidence == f"hang_loop_exit.py:{line_of('if loss.item() < 0.01:')} `if loss.item() < 0.01:`"
    assert "rank 1 left the loop (a `break`) while rank 0 ran on" in p.words
    assert "though its data had not run out (`loader` has 4 batches on every rank)" in p.words
    assert "all-reduce a stop flag" in p.fix and "Join" not in p.fix
    assert p.sentence() in str(e)


def test_a_rank_whose_loader_ran_out_first_is_uneven_inputs(hangs):
    e = hangs["uneven"]
    assert e is not None and e.autopsy is not None, "the launch should have hung and been diagnosed"
    p = e.autopsy.pattern
    assert p is not None and p.name == "uneven", str(e)
    assert p.evidence == f"hang_loop_exit.py:{line_of('for x, y in loader:')} `for x, y in loader:`"
    assert ("rank 0's loop ran more steps than rank 1's, whose data ran out first (`loader` has 5 batches on "
            "rank 0, 4 batches on rank 1)") in p.words
    assert "Join" in p.fix and "stop flag" not in p.fix
    assert e.autopsy.to_dict()["ranks"]["0"]["loaders"] == {"loader": 5}


def recognise(tmp_path, source, line, ranks):
    prog = tmp_path / "train.py"
    prog.write_text(source)
    patterns._parse.cache_clear()
    frames = [Frame(str(prog), line, "<module>")]
    return patterns.recognise({0: frames}, others_elsewhere=True, mismatch=True,
                              ranks={0: (frames, {}), **{r: ([Frame(str(prog), n, "<module>")], {}) for r, n in ranks}})


LOOP = ("import torch.distributed as dist\n"  # 1
        "for x in loader:\n"                    # 2
        "    loss = step(x)\n"                  # 3
        "    loss.backward()\n"                 # 4
        "dist.all_reduce(total)\n")             # 5


def test_a_loop_that_only_its_data_can_end_is_uneven_inputs(tmp_path):
    p = recognise(tmp_path, LOOP, 4, [(1, 5)])
    assert p.name == "uneven" and p.evidence == "train.py:2 `for x in loader:`" and "Join" in p.fix


def test_an_exception_caught_around_the_loop_is_a_rank_leaving_it(tmp_path):
    source = "try:\n" + "".join("    " + l + "\n" for l in LOOP.splitlines()[1:4]) + \
             "except RuntimeError as err:\n    print(err)\n" + LOOP.splitlines()[4] + "\n"
    p = recognise(tmp_path, LOOP.splitlines()[0] + "\n" + source, 5, [(1, 8)])
    assert p.name == "left_loop" and p.evidence == "train.py:6 `except RuntimeError as err:`", p
    assert "(an exception caught)" in p.words and "catch the exception inside the loop" in p.fix
    # the same loop, the other rank still inside it: no rank left, so neither pattern
    assert recognise(tmp_path, LOOP, 4, [(1, 3)]) is None or \
        recognise(tmp_path, LOOP, 4, [(1, 3)]).name not in ("left_loop", "uneven")


def test_a_ctrl_c_handler_around_the_program_is_no_early_stop(tmp_path):
    source = ("import torch.distributed as dist\n"     # 1
              "def main():\n"                           # 2
              "    for x in loader:\n"                  # 3
              "        step(x).backward()\n"            # 4
              "    dist.all_reduce(total)\n"            # 5
              "try:\n"                                  # 6
              "    main()\n"                            # 7
              "except KeyboardInterrupt:\n"             # 8
              "    pass\n")                             # 9
    prog = tmp_path / "train.py"
    prog.write_text(source)
    patterns._parse.cache_clear()
    inside = [Frame(str(prog), 7, "<module>"), Frame(str(prog), 4, "main")]
    gone = [Frame(str(prog), 7, "<module>"), Frame(str(prog), 5, "main")]
    p = patterns.recognise({0: inside}, others_elsewhere=True, mismatch=True, ranks={0: (inside, {}), 1: (gone, {})})
    assert p.name == "uneven", p
    prog.write_text(source.replace("KeyboardInterrupt", "RuntimeError"))
    patterns._parse.cache_clear()
    p = patterns.recognise({0: inside}, others_elsewhere=True, mismatch=True, ranks={0: (inside, {}), 1: (gone, {})})
    assert p.name == "left_loop" and p.evidence == "train.py:8 `except RuntimeError:`", p
