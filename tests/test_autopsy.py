"""The hang autopsy: a hung launch ends in one diagnosis that names the waiting rank(s), the
collective and the source line, whether the launcher's timeout ends it or the ranks' own short
process-group timeout does; `ddp-lab autopsy DIR` prints the same from the folder it left.

The seven hangs run once, side by side (module fixture), and every test reads their results.
An eighth launch beside them, of ranks that only sleep, tests the launcher's own timeout: both
ranks had started, and every process is killed (it waits as long as the two launcher-timeout hangs,
so it shares their wait instead of adding its own to test_launch.py).
"""
import concurrent.futures
import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import PROGRAMS, alive, processes_with, wait_until
from ddp_lab.engine import launch

COLLECTIVES = PROGRAMS / "hang_collectives.py"
TRAINING = PROGRAMS / "hang_training.py"
SLEEPER = PROGRAMS / "sleeper.py"
# Ranks that hang until the launcher's timeout must be in the hang before it ends. The three
# launcher-timeout launches start first and alone (their ranks reached the hang in 6 s on 2 idle
# cores); the others start only once those ranks are in it, and run while they wait.
# The test says so if the ranks never got there.
LAUNCHER_TIMEOUT = 60
PG_TIMEOUT = 5  # the others: gloo raises on every rank after this long in a collective
CASES = {  # name: (program, argument, process-group timeout or None for the launcher's)
    "mismatch": (COLLECTIVES, "mismatch", None),
    "sleeper": (COLLECTIVES, "sleeper", None),
    "timeout": (SLEEPER, None, None),  # no collective at all: ranks that sleep, ended by the launcher
    "rank0": (COLLECTIVES, "rank0", PG_TIMEOUT),
    "save": (COLLECTIVES, "save", PG_TIMEOUT),
    "nan": (TRAINING, "nan", PG_TIMEOUT),
    "uneven": (TRAINING, "uneven", PG_TIMEOUT),
    "dying": (COLLECTIVES, "dying", PG_TIMEOUT),
}
READY = {COLLECTIVES: "ready", TRAINING: "ready", SLEEPER: "sleeping"}  # what a rank prints once in the hang


def line_of(program: Path, code: str, after: str = "") -> int:
    """The line number of `code` in program (after the line holding `after`)."""
    lines = program.read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if after in l) if after else 0
    return next(i for i, l in enumerate(lines) if i >= start and l.strip().startswith(code)) + 1


@pytest.fixture(scope="module")
def hangs(tmp_path_factory):
    """{case: (LaunchError or None, seconds the launch took, its timeout)}, and the marker on every
    command line."""
    marker = str(tmp_path_factory.mktemp("hangs") / f"marker-{uuid.uuid4().hex[:12]}")

    def one(name):
        program, arg, pg_timeout = CASES[name]
        env = {"HANG_PG_TIMEOUT": str(pg_timeout)} if pg_timeout else {}
        timeout = LAUNCHER_TIMEOUT if pg_timeout is None else 240
        start = time.monotonic()
        try:
            launch.torchrun(program, nproc=2, args=[a for a in (arg, marker) if a], stream=False, env=env,
                            timeout=timeout)
        except launch.LaunchError as e:
            took = time.monotonic() - start
            assert pg_timeout or all(f"rank {r} {READY[program]}" in e.run.log for r in (0, 1)), \
                f"{name}: the ranks never reached the hang within {timeout} s:\n{e.run.log[-2000:]}"
            return e, took, timeout
        return None, time.monotonic() - start, timeout

    # The three launcher-timeout launches first, each in its own thread. The others take turns beside
    # them, three at a time, once those ranks are in their hang (or their launches ended): started
    # together, eight launches' imports would share two cores while the launcher's clock runs.
    waiting = [n for n in CASES if CASES[n][2] is None]
    ready = [f"{marker}.ready"] + [f"{marker}.{CASES[n][1]}.rank{r}.ready" for n in waiting
                                     if CASES[n][0] is COLLECTIVES for r in (0, 1)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = {n: pool.submit(one, n) for n in waiting}
        wait_until(lambda: all(Path(f).exists() for f in ready) or any(f.done() for f in futures.values()),
                   timeout=LAUNCHER_TIMEOUT)
        futures.update({n: pool.submit(one, n) for n in CASES if n not in futures})
        results = {n: futures[n].result() for n in CASES}
    return results, marker


def error(hangs, name) -> launch.LaunchError:
    e = hangs[0][name][0]
    assert e is not None, f"{name}: the launch should have failed"
    return e


def diagnosis_lines(e) -> list:
    """The diagnosis at the top of the message (under the launcher's timeout line): what happened,
    then one line per rank."""
    lines = str(e).splitlines()
    if lines[0].startswith("timed out after"):
        lines = lines[1:]
    assert lines[0].startswith("the job hung "), lines[:4]
    ranks = [x for x in lines[1:1 + len(e.autopsy.ranks)] if x.startswith("  rank ")]
    assert len(ranks) == len(e.autopsy.ranks), lines[:6]
    return [lines[0], *ranks]


def test_launcher_timeout_mismatched_collectives(hangs):
    e = error(hangs, "mismatch")
    message = str(e)
    timeout = hangs[0]["mismatch"][2]
    assert message.startswith(f"timed out after {timeout} s; every process of this launch was killed.\n")
    reduce_at = line_of(COLLECTIVES, "dist.all_reduce(stats)", 'if how == "mismatch"')
    barrier_at = line_of(COLLECTIVES, "dist.barrier()", 'if how == "mismatch"')
    # The program runs three all_reduces that match, so the mismatch is collective #4.
    assert diagnosis_lines(e) == ["the job hung at collective #4: the ranks called different collectives",
                                  f"  rank 0 waits in all_reduce #4 (hang_collectives.py:{reduce_at})",
                                  f"  rank 1 waits in barrier #4 (hang_collectives.py:{barrier_at})"]
    assert e.autopsy.headline == (f"rank 0 waits in all_reduce #4 (hang_collectives.py:{reduce_at}); rank 1 waits "
                                  f"in barrier #4 (hang_collectives.py:{barrier_at}): the ranks called different "
                                  "collectives")
    assert e.autopsy.kind == "mismatch"
    assert e.autopsy.ranks[0].collective.op == "all_reduce" and e.autopsy.ranks[1].collective.op == "barrier"
    assert e.autopsy.ranks[0].source == "live"  # asked while the ranks were still alive


def test_launcher_timeout_sleeping_rank(hangs):
    e = error(hangs, "sleeper")
    reduce_at = line_of(COLLECTIVES, "dist.all_reduce(stats)", 'elif how == "sleeper"')
    sleep_at = line_of(COLLECTIVES, "time.sleep(0.1)")
    assert diagnosis_lines(e) == ["the job hung at collective #4: not every rank reached it",
                                  f"  rank 0 waits in all_reduce #4 (hang_collectives.py:{reduce_at})",
                                  f"  rank 1 never reached collective #4; its stack: hang_collectives.py:{sleep_at} "
                                  "in evaluate"]
    assert e.autopsy.ranks[1].state == "elsewhere"


def test_launcher_timeout_kills_every_process(hangs):
    # Ranks that sleep outside any collective: the launcher's timeout ends them, and nothing survives
    e = error(hangs, "timeout")
    timeout = hangs[0]["timeout"][2]
    assert str(e).startswith(f"timed out after {timeout} s"), str(e)[:300]
    pids = [r["pid"] for r in e.run.select(kind="pid")]
    assert len(pids) == 2, "both workers should have started before the timeout"
    assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout=10), pids


def test_the_diagnosis_arrives_within_the_timeout_plus_15_s(hangs):
    for name in ("mismatch", "sleeper", "timeout"):
        _, took, timeout = hangs[0][name]
        assert took <= timeout + 15, (name, took, timeout)


def test_collective_only_on_rank_0(hangs):
    e = error(hangs, "rank0")
    reduce_at = line_of(COLLECTIVES, "dist.all_reduce(stats)", 'elif how == "rank0"')
    summary, rank0, rank1 = diagnosis_lines(e)
    assert summary == "the job hung at collective #4: the ranks called different collectives"
    assert rank0 == f"  rank 0 was waiting in all_reduce #4 (hang_collectives.py:{reduce_at})"
    assert rank1.startswith("  rank 1 was waiting in barrier #4")
    assert e.autopsy.pattern.name == "rank_condition" and e.autopsy.pattern.rule == "DDP009"
    assert f"hang_collectives.py:{reduce_at - 1} `if rank == 0:`" in str(e)
    # DDP009 does not flag it here (all_reduce also runs on every rank in main), and says so
    assert "rule DDP009 looks for this pattern before a run, but does not flag this code" in str(e)
    assert 'notebooks/07_troubleshooting.ipynb, section "1. A rank skips a collective"' in str(e)
    assert re.search(r"^rank \d failed: ", str(e), re.M)  # today's message is still there, below


def test_barrier_only_in_rank_0s_save_path(hangs):
    e = error(hangs, "save")
    barrier_at = line_of(COLLECTIVES, "dist.barrier()", "def save")
    reduce_at = line_of(COLLECTIVES, "dist.all_reduce(stats)", 'elif how == "save"')
    summary, rank0, rank1 = diagnosis_lines(e)
    assert rank0 == f"  rank 0 was waiting in barrier #4 (hang_collectives.py:{barrier_at})"
    assert rank1 == f"  rank 1 was waiting in all_reduce #4 (hang_collectives.py:{reduce_at})"
    # The barrier itself is in save(); the rank condition is at the call.
    assert e.autopsy.pattern.name == "rank_condition"
    assert f"hang_collectives.py:{reduce_at - 2} `if rank == 0:`" in str(e)


# Backward's all-reduce, named from the Flight Recorder entry (with its number) or, when the ranks
# were stopped before they could dump it (the process-group timeout raises on both ranks at once,
# and torchrun stops the slower one; seen under load), from the stack alone: either names the
# collective and the line.
GRADIENT_ALL_REDUCE = r"(?:all_reduce #\d+|backward's gradient all-reduce)"


def test_nan_skipped_on_one_rank(hangs):
    e = error(hangs, "nan")
    backward_at = line_of(TRAINING, "loss.backward()", "def train_skipping_nan")
    total_at = line_of(TRAINING, "dist.all_reduce(total)")
    summary, rank0, rank1 = diagnosis_lines(e)
    assert re.fullmatch(rf"  rank 0 was waiting in {GRADIENT_ALL_REDUCE} \(hang_training.py:{backward_at}\)", rank0), rank0
    assert rank1.startswith("  rank 1 was waiting in all_reduce") and rank1.endswith(f"(hang_training.py:{total_at})")
    assert e.autopsy.pattern.name == "skip"
    assert "a NaN skip on one rank" in str(e) and "`if torch.isnan(loss):`" in str(e)


def test_uneven_batches_without_join(hangs):
    e = error(hangs, "uneven")
    backward_at = line_of(TRAINING, "loss.backward()", "def train(")
    summary, rank0, rank1 = diagnosis_lines(e)
    assert re.fullmatch(rf"  rank 0 was waiting in {GRADIENT_ALL_REDUCE} \(hang_training.py:{backward_at}\)", rank0), rank0
    assert e.autopsy.pattern.name == "uneven"
    assert 'notebooks/02_sampler_and_metrics.ipynb, section "5. Uneven batches per rank' in str(e)


def test_a_rank_stopped_in_its_excepthook_is_still_named_with_its_error(hangs):
    # Rank 0 fails first, but its own excepthook still runs when rank 1 times out, asks it for
    # a dump and exits; torchrun then stops rank 0 before the autopsy's excepthook writes
    # exception.json. Rank 0's answer to rank 1's request carries its exception.
    e = error(hangs, "dying")
    reduce_at = line_of(COLLECTIVES, "dist.all_reduce(stats)", 'elif how == "dying"')
    raise_at = line_of(COLLECTIVES, "raise RuntimeError", 'elif how == "dying"')
    summary, waiting, failed = diagnosis_lines(e)
    assert summary == "the job hung at collective #4: not every rank reached it"
    assert waiting == f"  rank 1 was waiting in all_reduce #4 (hang_collectives.py:{reduce_at})"
    assert failed == (f"  rank 0 never reached collective #4: it failed first at hang_collectives.py:{raise_at} "
                      "in main: RuntimeError: a corrupt batch on rank 0")
    folder = Path(e.autopsy.folder)
    assert not (folder / "rank0.exception.json").exists()  # stopped before it wrote it
    assert json.loads((folder / "rank0.request.json").read_text())["exception"]["type"] == "RuntimeError"


def test_no_process_is_left_behind(hangs):
    assert wait_until(lambda: not processes_with(hangs[1]), timeout=10), processes_with(hangs[1])


def test_the_folder_holds_every_ranks_detail(hangs):
    d = error(hangs, "mismatch").autopsy
    folder = Path(d.folder)
    assert (folder / "diagnosis.txt").read_text() == d.message() + "\n"
    # the message shows a few frames per rank; the file it names holds every rank's whole stack
    whole = (folder / "tracebacks.txt").read_text()
    assert f"(the whole stacks and tracebacks: {folder / 'tracebacks.txt'}):" in d.message()
    assert len(re.findall(r"^  rank \d \(live\): .+ in main$", d.message(), re.M)) == 2
    for rank in (0, 1):
        assert f"=== rank {rank}: stack from live" in whole
    assert whole.count("Traceback (most recent call last):") == 2 and "distributed_c10d.py" in whole
    for rank in (0, 1):
        assert json.loads((folder / f"rank{rank}.request.json").read_text())["threads"]
        # torch's own Flight Recorder reader takes what the ranks dumped
        from torch.distributed.flight_recorder.components.loader import read_dump
        dump = read_dump("fr_trace_rank_", str(folder / f"fr_trace_rank_{rank}"))
        assert [e["collective_seq_id"] for e in dump["entries"]] == [1, 2, 3, 4]


def test_cli_prints_the_same_diagnosis_from_the_folder(hangs):
    d = error(hangs, "mismatch").autopsy
    out = subprocess.run([sys.executable, "-m", "ddp_lab.cli", "autopsy", d.folder],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (Path(d.folder) / "diagnosis.txt").read_text()
    out = subprocess.run([sys.executable, "-m", "ddp_lab.cli", "autopsy", d.folder, "--json"],
                         capture_output=True, text=True, timeout=120)
    data = json.loads(out.stdout)
    assert data["headline"] == d.headline and data["kind"] == "mismatch"
    assert data["ranks"]["1"]["collective"]["op"] == "barrier"
