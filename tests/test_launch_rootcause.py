"""LaunchError blames the rank that failed first, and says how it died, in words.

When one rank dies, the others fail a moment later with "Connection reset by
peer" or a timeout: those errors are consequences and must never be blamed.
"""
import pytest

from conftest import PROGRAMS
from ddp_lab.engine import launch
from ddp_lab.engine._rootcause import root_cause

DIES = PROGRAMS / "dies.py"

# (mode, survivor exits at once?, rank to blame, words the message must contain)
CASES = [
    ("sigkill", False, 1, ["rank 1 was killed by SIGKILL", "out-of-memory killer", "rank 1 dies now (sigkill)"]),
    # The survivor exits within the same second: torchrun's Root Cause block then often
    # names it (exit code 1) instead of the SIGKILLed rank.
    ("sigkill", True, 1, ["rank 1 was killed by SIGKILL", "out-of-memory killer"]),
    ("sigsegv", True, 1, ["rank 1 was killed by SIGSEGV", "crash in native code"]),
    ("exit3", False, 1, ["rank 1 exited with code 3 without a traceback", "rank 1 dies now (exit3)"]),
    ("abort", True, 1, ["rank 1 was killed by SIGABRT", "C++ abort"]),
    # Rank 1 skipped a collective, but rank 0 is the rank that failed: gloo aborts it in
    # C++ (no Python traceback) while rank 1 only loses its connection to rank 0.
    ("desync", False, 0, ["rank 0 failed: C++ abort: terminate called after throwing an instance of "
                          "'gloo::EnforceNotMet'", "collective mismatch", "ranks disagree"]),
]


@pytest.mark.parametrize("mode,at_once,rank,words", CASES,
                         ids=[f"{m}{'-exit-at-once' if a else ''}" for m, a, _, _ in CASES])
def test_the_rank_that_died_first_is_blamed(mode, at_once, rank, words):
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(DIES, nproc=2, args=[mode] + (["exit-at-once"] if at_once else []),
                        stream=False, timeout=120)
    message = str(info.value)
    assert info.value.rank == rank, message
    for w in words:
        assert w in message, message
    assert "Connection reset" not in message.splitlines()[0]
    assert "Connection closed" not in message.splitlines()[0]


# What torchrun printed when rank 1 was SIGKILLed and rank 0 exited (code 1, its own
# "Connection reset" traceback) before torchrun's next poll, trimmed to what matters.
KILLED_BUT_ROOT_CAUSE_SAYS_RANK_0 = """\
[0]:step 2
[0]:[rank0]: Traceback (most recent call last):
[0]:[rank0]:   File "prog.py", line 12, in <module>
[0]:[rank0]:     dist.all_reduce(t)
[0]:[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:4242: Connection reset by peer.
[1]:step 2
E1130 08:51:36.913000 7000 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 7001) of binary: python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
prog.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_08:51:36
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 7002)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 7002
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_08:51:36
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 7001)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def _rank_output(log):
    lines = {}
    for line in log.splitlines():
        if line[:1] == "[" and line[2:4] == "]:" and line[1].isdigit():
            lines.setdefault(int(line[1]), []).append(line[4:].removeprefix(f"[rank{line[1]}]: "))
    return lines


def test_a_secondary_error_never_outranks_a_signal_even_against_torchruns_root_cause():
    message, rank = root_cause(KILLED_BUT_ROOT_CAUSE_SAYS_RANK_0, _rank_output(KILLED_BUT_ROOT_CAUSE_SAYS_RANK_0))
    assert rank == 1
    assert message.startswith("rank 1 was killed by SIGKILL: often the out-of-memory killer")
    assert message.endswith("Last lines of rank 1:\n    step 2")


def test_a_rank_stopped_by_torchrun_is_not_blamed_for_its_signal():
    # Rank 1 raised; rank 0 was still running and torchrun stopped it (SIGTERM, then it is
    # listed with exit code -15): rank 1's own error is the cause.
    log = ("[1]:Traceback (most recent call last):\n[1]:  File \"p.py\", line 3\n"
           "[1]:ValueError: bad shard\n"
           "W1130 08:27:29 3752 api.py:1028] Sending process 3757 closing signal SIGTERM\n"
           "Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 3757)  (SIGTERM)\n"
           "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
           "  exitcode  : 1 (pid: 3758)\n")
    message, rank = root_cause(log, _rank_output(log))
    assert (rank, message.splitlines()[0]) == (1, "rank 1 failed: ValueError: bad shard")


def test_an_exception_raised_while_handling_a_lost_peer_is_secondary():
    # `raise TrainingFailed(...) from e` around a Connection reset is still a consequence.
    errors = {0: ["Traceback (most recent call last):", "  File \"p.py\", line 9",
                  "RuntimeError: Connection reset by peer", "",
                  "The above exception was the direct cause of the following exception:", "",
                  "Traceback (most recent call last):", "  File \"p.py\", line 11",
                  "TrainingFailed: step 3 failed"],
              1: ["step 2"]}
    log = ("Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 11)\n"
           "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
           "  exitcode  : -11 (pid: 12)  (SIGSEGV)\n")
    message, rank = root_cause(log, errors)
    assert rank == 1 and "killed by SIGSEGV" in message


def test_an_abort_on_the_way_out_after_a_lost_peer_is_secondary():
    # A rank that lost its peer may also abort during exit; its first error is what counts.
    errors = {0: ["Traceback (most recent call last):", "  File \"p.py\", line 9",
                  "RuntimeError: Connection closed by peer",
                  "terminate called without an active exception"],
              1: ["step 2"]}
    log = ("Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -6 (pid: 11)  (SIGABRT)\n"
           "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
           "  exitcode  : 3 (pid: 12)\n")
    message, rank = root_cause(log, errors)
    assert rank == 1 and message.startswith("rank 1 exited with code 3 without a traceback")


def test_a_print_inside_a_traceback_does_not_become_the_error():
    # stdout and stderr reach the launcher separately; a print that lands between a
    # traceback's lines in the merged output must not be taken for the exception.
    merged = {0: ["Traceback (most recent call last):", "step 0", "  File \"p.py\", line 9",
                  "RuntimeError: Connection reset by peer"],
              1: ["step 0", "rank 1 dies now"]}
    errors = {0: ["Traceback (most recent call last):", "  File \"p.py\", line 9",
                  "RuntimeError: Connection reset by peer"]}
    log = ("Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 11)\n"
           "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
           "  exitcode  : -9 (pid: 12)  (SIGKILL)\n")
    message, rank = root_cause(log, merged, errors)
    assert rank == 1 and "killed by SIGKILL" in message


def test_when_every_error_is_secondary_the_rank_that_hung_is_named():
    # Rank 0 timed out in a collective; rank 1 never joined it and torchrun stopped it.
    errors = {0: ["Traceback (most recent call last):", "  File \"p.py\", line 9",
                  "RuntimeError: Timed out waiting 5000ms for recv operation to complete"]}
    lines = {0: errors[0], 1: ["step 2 done", "loading the next shard"]}
    log = ("W1130 1 api.py] Sending process 12 closing signal SIGTERM\n"
           "Failures:\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -15 (pid: 12)  (SIGTERM)\n"
           "Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n"
           "  exitcode  : 1 (pid: 11)\n")
    message, rank = root_cause(log, lines, errors)
    assert rank == 0
    assert message.startswith("rank 0 failed: RuntimeError: Timed out waiting 5000ms")
    assert "rank 1 was still running when torchrun stopped it; its last output: " \
           "'loading the next shard'" in message


def test_a_failing_rank_releases_the_group_only_after_its_traceback_is_out():
    """Released first (in runtime.distributed's finally), the group woke rank 0's all-reduce with
    "Connection closed"; rank 0 exited, torchrun stopped rank 1 before its traceback printed,
    and the secondary error was blamed."""
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(PROGRAMS / "slow_traceback.py", nproc=2, stream=False, timeout=120)
    assert info.value.rank == 1, str(info.value)
    assert "rank 1's own error" in str(info.value).splitlines()[0], str(info.value)
