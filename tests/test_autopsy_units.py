"""The autopsy's parts without a launch: the injection, the readers, and the fallback rule
(anything that goes wrong inside the autopsy leaves the launcher's message as it was)."""
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from conftest import wait_until
from ddp_lab.engine import launch
from ddp_lab.autopsy import collect, diagnose, evidence
from ddp_lab.autopsy.command import run as cli_run


def _python(code, env, cwd):
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_injection_arms_only_ranks_and_keeps_an_existing_sitecustomize(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    folder = tmp_path / "autopsy"
    folder.mkdir()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", collect.DIR_ENV)}
    base["PYTHONPATH"] = os.pathsep.join([str(collect.INJECT), str(theirs)])
    code = "import os, sys; print(os.environ.get('THEIRS_RAN'), sys.modules['sitecustomize'].__file__)"
    # Not a rank (no RANK): nothing armed, their sitecustomize still runs.
    out = _python(code, {**base, collect.DIR_ENV: str(folder)}, tmp_path)
    assert out.stdout.split() == ["1", str(theirs / "sitecustomize.py")], out.stderr
    assert list(folder.iterdir()) == []
    # A rank: armed (pid, FIFO, faulthandler files), and theirs still runs.
    out = _python(code, {**base, collect.DIR_ENV: str(folder), "RANK": "3"}, tmp_path)
    assert out.stdout.split()[0] == "1", out.stderr
    names = {p.name for p in folder.iterdir()}
    assert {"rank3.pid", "rank3.ctl", "rank3.sigterm.txt", "rank3.exit.json"} <= names
    # An uncaught exception leaves its traceback; the exit status and stderr are as before.
    out = _python("def f():\n    raise ValueError('boom')\nf()", {**base, collect.DIR_ENV: str(folder), "RANK": "3"},
                  tmp_path)
    assert out.returncode == 1 and out.stderr.rstrip().endswith("ValueError: boom")
    exc = json.loads((folder / "rank3.exception.json").read_text())["exception"]
    assert exc["type"] == "ValueError" and [f["line"] for f in exc["frames"]] == [3, 2]


def test_flight_recorder_dump_of_a_real_process_group_is_read(tmp_path):
    # One real gloo process (world of 1) with the Flight Recorder on, armed by the injection;
    # it fails after its collectives: its traceback and its Flight Recorder entries are dumped.
    prog = tmp_path / "one.py"
    prog.write_text(textwrap.dedent("""\
        import datetime, sys
        import torch, torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
        dist.all_reduce(torch.ones(3))
        dist.broadcast(torch.ones(2, 2), 0)
        dist.destroy_process_group()
        raise RuntimeError("after the collectives")
        """))
    folder = tmp_path / "d"
    folder.mkdir()
    env = {**os.environ, collect.DIR_ENV: str(folder), "RANK": "0", "TORCH_FR_BUFFER_SIZE": "100",
           "PYTHONPATH": str(collect.INJECT)}
    out = subprocess.run([sys.executable, str(prog), str(launch.free_port())], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1 and "RuntimeError: after the collectives" in out.stderr, out.stderr
    ev = evidence.read_folder(folder)[0]
    assert ev.exception == "RuntimeError: after the collectives" and ev.stack[-1].line == 7
    assert [(c.seq, c.op, c.sizes) for c in ev.collectives] == [(1, "all_reduce", [[3]]), (2, "broadcast", [[2, 2]])]
    assert (folder / "rank0.exit.json").exists()  # atexit still ran, after the exception's dump


def _fr(entries):
    """A Flight Recorder dump as torch writes it (the fields evidence reads)."""
    return {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": [
        {"collective_seq_id": seq, "profiling_name": f"nccl:{op}", "input_sizes": sizes, "is_p2p": False,
         "process_group": ("0", "default_pg"),
         "frames": [{"name": op, "filename": "/x/site-packages/torch/distributed/distributed_c10d.py", "line": 1},
                    {"name": "main", "filename": "/job/train.py", "line": line}]}
        for seq, op, sizes, line in entries]}


def test_a_cluster_jobs_nccl_dumps_and_error_files(tmp_path, capsys):
    # rank 0 timed out in all_reduce #3 (its @record error file says so); rank 1 never got there.
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(_fr([(1, "broadcast", [[4]], 10),
                                                                   (2, "all_reduce", [[4]], 20),
                                                                   (3, "all_reduce", [[4]], 20)])))
    (tmp_path / "nccl_trace_rank_1").write_bytes(pickle.dumps(_fr([(1, "broadcast", [[4]], 10),
                                                                   (2, "all_reduce", [[4]], 20)])))
    err = tmp_path / "attempt_0" / "0"
    err.mkdir(parents=True)
    stack = ('Traceback (most recent call last):\n  File "/job/train.py", line 20, in main\n'
             '  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 3913, in all_reduce\n'
             "torch.distributed.DistBackendError: Watchdog caught collective operation timeout\n")
    (err / "error.json").write_text(json.dumps({"message": {
        "message": "DistBackendError: Watchdog caught collective operation timeout",
        "extraInfo": {"py_callstack": stack, "timestamp": "0"}}}))
    d = diagnose.diagnose_folder(tmp_path, world_size=2)
    assert d.headline.startswith("rank 0 was waiting in all_reduce #3 (train.py:20); rank 1 ")
    assert "rank 1 could not be inspected" in d.headline  # no stack of rank 1: said, not guessed
    assert cli_run(type("A", (), {"dir": str(tmp_path), "json": True, "world_size": 2})()) == 0
    assert json.loads(capsys.readouterr().out)["ranks"]["0"]["collective"]["seq"] == 3


def test_nothing_to_read_is_no_diagnosis(tmp_path, capsys):
    (tmp_path / "rank0.request.json").write_text("{torn")  # an unreadable dump is skipped
    (tmp_path / "fr_trace_rank_1").write_bytes(b"\x80garbage")
    assert diagnose.diagnose_folder(tmp_path, world_size=2) is None
    assert cli_run(type("A", (), {"dir": str(tmp_path), "json": False, "world_size": None})()) == 1
    assert "nothing in" in capsys.readouterr().out


def test_a_failing_autopsy_leaves_todays_message(tmp_path, monkeypatch):
    autopsy = collect.Autopsy()
    autopsy.collect([os.getpid()])  # nothing armed: returns, never raises
    assert launch._diagnose(autopsy, 2) is None  # empty folder: no diagnosis, folder removed
    assert not autopsy.folder.exists()
    autopsy = collect.Autopsy()
    (autopsy.folder / "rank0.request.json").write_text(json.dumps(
        {"threads": [{"main": True, "frames": [{"file": "/job/t.py", "line": 3, "name": "f"}]}]}))

    def broken(*a, **k):
        raise RuntimeError("a bug in the autopsy")

    monkeypatch.setattr(diagnose, "diagnose_folder", broken)
    assert autopsy.diagnosis(2) is None
    autopsy.discard()
    # Switched off: the environment is untouched.
    env = {collect.SWITCH_ENV: "0"}
    assert collect.start(env) is None and env == {collect.SWITCH_ENV: "0"}


def test_faulthandler_text_gives_the_main_threads_stack():
    text = textwrap.dedent("""\
        Thread 0x00007f0f47b666c0 (most recent call first):
          File "/x/ddp_lab/autopsy/_inject/sitecustomize.py", line 109 in serve
          File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

        Current thread 0x00007f0f485c6b80 (most recent call first):
          File "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
          File "/job/train.py", line 37 in main
          File "/job/train.py", line 44 in <module>
        """)
    frames = evidence.parse_faulthandler(text)
    assert [(f.line, f.name) for f in frames] == [(44, "<module>"), (37, "main"), (3913, "all_reduce")]
    assert evidence.in_collective(frames) and evidence.user_frame(frames).line == 37


def test_frames_of_the_verify_observer_are_machinery_not_the_program():
    """Under `ddp-lab verify` the observer's step hook (its barrier at --steps N) is on the stack:
    the rank's "where" is the program's line that called optimizer.step(), not the observer's."""
    frames = [evidence.Frame("/job/train.py", 50, "<module>"), evidence.Frame("/job/train.py", 31, "train"),
              evidence.Frame("/usr/lib/python3.11/site-packages/torch/optim/optimizer.py", 493, "wrapper"),
              evidence.Frame("/x/ddp_lab/verify/_inject/sitecustomize.py", 212, "after_step"),
              evidence.Frame("/x/ddp_lab/verify/runner.py", 10, "helper")]
    assert evidence.is_library(frames[-2].file) and evidence.is_library(frames[-1].file)
    assert evidence.user_frame(frames) == frames[1]
    assert not evidence.is_library("/job/verify/train.py")  # a user's own folder named verify is the program


def test_a_pattern_names_the_lesson_and_whether_the_check_rule_flags_the_code(tmp_path):
    from ddp_lab.autopsy import patterns
    from ddp_lab.autopsy.evidence import Frame
    prog = tmp_path / "train.py"
    prog.write_text("import torch.distributed as dist\n"
                    "dist.init_process_group('gloo')\n"
                    "rank = dist.get_rank()\n"
                    "if rank == 0:\n"
                    "    dist.all_reduce(x)\n")
    p = patterns.recognise({0: [Frame(str(prog), 5, "<module>")]}, others_elsewhere=True, mismatch=False)
    assert (p.name, p.rule, p.flagged, p.evidence) == ("rank_condition", "DDP009", True, "train.py:4 `if rank == 0:`")
    assert "rule DDP009 flags this code" in p.sentence()
    assert '"1. A rank skips a collective"' in p.sentence()
    # An if/else on the rank gives every rank a collective: a mismatch, not a skipped one.
    prog.write_text(prog.read_text() + "else:\n    dist.barrier()\n")
    patterns._parse.cache_clear()
    p = patterns.recognise({0: [Frame(str(prog), 5, "<module>")]}, others_elsewhere=True, mismatch=True)
    assert p.name == "mismatch" and p.rule is None


def _frame(file, line, name):
    return evidence.Frame(file, line, name)


def test_a_rank_that_called_another_collective_at_the_same_number_is_a_mismatch_not_missing():
    # Rank 0 waits in all_reduce #5 (a logging all_reduce under `if rank == 0`); rank 1 called
    # DDP's broadcast #5 and then lost its peers: it did reach #5, with another collective.
    torch_file = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    site0, site1 = _frame("/work/train.py", 30, "train"), _frame("/work/train.py", 24, "train")
    r0 = evidence.RankEvidence(0, collectives=[evidence.Collective(5, "all_reduce", [[]], "0", site0)],
                               stack=[site0, _frame(torch_file, 2800, "all_reduce")], stack_from="live")
    r1 = evidence.RankEvidence(1, collectives=[evidence.Collective(5, "broadcast", [[3]], "0", site1)],
                               stack=[site1], stack_from="exception",
                               exception="DistBackendError: Connection closed by peer")
    d = diagnose.diagnose({0: r0, 1: r1}, 2)
    assert d.kind == "mismatch", d.headline
    assert d.headline == ("rank 0 waits in all_reduce #5 (train.py:30); rank 1 called broadcast #5 [3] "
                          "(train.py:24) instead, then lost its peers: the ranks called different collectives")


def test_a_rank_tearing_its_group_down_is_not_waiting_in_a_collective():
    torch_file = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    frames = [_frame("/work/train.py", 40, "main"), _frame(torch_file, 2100, "destroy_process_group")]
    assert not evidence.in_collective(frames)
    assert evidence.in_collective(frames[:1] + [_frame(torch_file, 2800, "all_reduce")])


def test_a_rank_in_its_excepthook_answers_with_the_exception_but_a_stale_one_is_ignored(tmp_path):
    # The injection's _Arm, run in a child (importing the injection here would arm nothing, but
    # would chain into this interpreter's sitecustomize): Python sets sys.last_value before it calls
    # sys.excepthook, when the hooks' frames are the main thread's whole stack; a program still
    # running (a module frame, or `python -m`'s runner, outermost) may hold a stale one (IPython).
    code = textwrap.dedent(f"""
        import importlib.util, sys, threading
        spec = importlib.util.spec_from_file_location("inject", {str(collect.INJECT / "sitecustomize.py")!r})
        inject = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(inject)
        arm = inject._Arm({str(tmp_path)!r}, 0)
        sys.last_value = ValueError("an earlier cell's error")
        print("running:", arm.dying(sys._getframe()))
        seen = []
        hook = threading.Thread(target=lambda: seen.append(arm.dying(sys._getframe())))  # no module frame
        hook.start(); hook.join()
        print("in a hook:", seen[0][0].__name__, seen[0][1])
        arm.exc = (KeyError, KeyError("ours"), None)
        print("ours:", arm.dying(None)[1])
        """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", collect.DIR_ENV)}
    for argv in (["-c", code], ["-m", "probe"]):
        (tmp_path / "probe.py").write_text(code)
        out = subprocess.run([sys.executable, *argv], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
        assert out.stdout.splitlines() == ["running: None", "in a hook: ValueError an earlier cell's error",
                                           "ours: 'ours'"], (argv, out.stdout, out.stderr)


def test_a_rank_stopped_while_its_hooks_run_has_already_written_its_exception(tmp_path):
    # What torchrun does when another rank dies without asking (a crash, an abort): it stops this
    # rank while its excepthooks still print and dump. The hook that runs inside ours stalls here
    # (a log sink), and the rank is stopped there: the exception must already be on disk.
    folder = tmp_path / "autopsy"
    folder.mkdir()
    printing = tmp_path / "printing"
    code = textwrap.dedent(f"""
        import importlib.util, os, signal, sys, time
        spec = importlib.util.spec_from_file_location("inject", {str(collect.INJECT / "sitecustomize.py")!r})
        inject = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(inject)
        def stalled_sink(etype, value, tb):  # the hook ours calls first: it never returns
            open({str(printing)!r}, "w").close()
            time.sleep(600)
        sys.excepthook = stalled_sink
        inject._Arm({str(folder)!r}, 0).arm()
        def main():
            raise RuntimeError("a corrupt batch on rank 0")
        main()
        """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", collect.DIR_ENV)}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: printing.exists() or child.poll() is not None, timeout=120, step=0.05)
        assert printing.exists(), child.communicate(timeout=10)
        child.terminate()  # what torchrun sends
        child.wait(timeout=30)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == -15
    info = json.loads((folder / "rank0.exception.json").read_text())["exception"]
    assert (info["type"], info["message"], info["frames"][-1]["name"]) == (
        "RuntimeError", "a corrupt batch on rank 0", "main")
    ranks = evidence.read_folder(folder)
    assert ranks[0].stack_from == "exception" and ranks[0].exception == "RuntimeError: a corrupt batch on rank 0"


TORCH_C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _hung_job(tmp_path):
    """A program whose rank 0 waits in an all_reduce under `if rank == 0:` (a comment after it),
    five calls deep; rank 1 is elsewhere. Returns (folder, program, {name: line})."""
    prog = tmp_path / "train.py"
    prog.write_text(textwrap.dedent("""\
        import torch.distributed as dist
        def log(x, rank):
            if rank == 0:   # only rank 0 logs: the bug
                dist.all_reduce(x)
        def step(x, rank): log(x, rank)
        def epoch(x, rank): step(x, rank)
        def train(x, rank): epoch(x, rank)
        def evaluate(): pass
        train(1, 0)
        """))
    folder = tmp_path / "dumps"
    folder.mkdir()
    f = str(prog)

    def request(frames):
        return json.dumps({"threads": [{"main": True, "frames": [
            {"file": file, "line": line, "name": name} for file, line, name in frames]}]})
    (folder / "rank0.request.json").write_text(request(
        [(f, 9, "<module>"), (f, 7, "train"), (f, 6, "epoch"), (f, 5, "step"), (f, 4, "log"),
         (TORCH_C10D, 2800, "all_reduce")]))
    (folder / "rank1.request.json").write_text(request([(f, 9, "<module>"), (f, 8, "evaluate")]))
    return folder, prog


def test_the_message_reads_top_down_with_a_few_frames_per_rank(tmp_path):
    folder, prog = _hung_job(tmp_path)
    d = diagnose.diagnose_folder(folder, world_size=2)
    lines = d.message().splitlines()
    # what happened; one line per rank (its collective and line); the pattern and its fix
    assert lines[:3] == ["the job hung in a collective: not every rank reached it",
                         "  rank 0 waits in all_reduce (train.py:4)",
                         "  rank 1 never reached that collective; its stack: train.py:8 in evaluate"], lines
    assert lines[3].startswith("Known pattern: a collective under a rank condition") and " Fix: " in lines[3]
    # the quoted source line without its trailing comment
    assert "(train.py:3 `if rank == 0:`)" in lines[3] and "only rank 0 logs" not in d.message()
    # then the program's innermost frames: 3 of rank 0's 5, none of torch's; the files named
    assert lines[4].startswith("The program's last 3 frames per rank")
    assert lines[5] == ("  rank 0 (live, rank0.request.json): train.py:6 in epoch > train.py:5 in step > "
                        "train.py:4 in log")
    assert lines[6] == "  rank 1 (live, rank1.request.json): train.py:9 in <module> > train.py:8 in evaluate"
    assert lines[7] == f"Every rank's dumps, Flight Recorder entries included: {folder}" and len(lines) == 8
    # the headline is the per-rank lines in one sentence (LaunchError.autopsy.headline, --json)
    assert d.headline == "; ".join(x.strip() for x in lines[1:3])


def test_the_launchers_diagnosis_keeps_the_whole_stacks_in_the_file_it_names(tmp_path):
    folder, prog = _hung_job(tmp_path)
    autopsy = collect.Autopsy()
    try:
        for p in folder.iterdir():
            (autopsy.folder / p.name).write_text(p.read_text())
        d = autopsy.diagnosis(2)
        whole = autopsy.folder / "tracebacks.txt"
        assert d.tracebacks == str(whole)
        assert f"(the whole stacks and tracebacks: {whole}):" in d.message()
        assert (autopsy.folder / "diagnosis.txt").read_text() == d.message() + "\n"
        text = whole.read_text()
        # every frame, torch's too, with its source line, as Python prints a traceback
        assert f'  File "{prog}", line 7, in train\n    def train(x, rank): epoch(x, rank)\n' in text
        assert f'  File "{TORCH_C10D}", line 2800, in all_reduce' in text
        assert f'  File "{prog}", line 4, in log\n    dist.all_reduce(x)\n' in text
        # `ddp-lab autopsy` on the kept folder names the same file
        assert diagnose.diagnose_folder(autopsy.folder, 2).tracebacks == str(whole)
    finally:
        autopsy.discard()


def test_quoted_source_lines_drop_their_trailing_comment():
    from ddp_lab.autopsy.patterns import _code
    lines = ["if rank == 0:  # the bug", 'x = "a # b"  # c', "foo(a,  # an argument", "   # alone", "y = 1"]
    assert [_code(lines, n) for n in range(1, 6)] == ["if rank == 0:", 'x = "a # b"', "foo(a,", "", "y = 1"]
    assert _code(lines, 0) == "" and _code(lines, 6) == ""


def test_a_reader_that_closes_the_pipe_early_ends_the_command_quietly(tmp_path):
    # `ddp-lab autopsy DIR | head`: far more output than a pipe holds (a rank line each for 20,000
    # ranks), so the command is still writing when the reader goes away.
    folder, _ = _hung_job(tmp_path)
    for extra in ([], ["--json"]):
        child = subprocess.Popen([sys.executable, "-m", "ddp_lab.cli", "autopsy", str(folder), "--world-size",
                                  "20000", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = child.stdout.readline()
        child.stdout.close()
        err = child.stderr.read()
        assert child.wait(timeout=120) == 0, err
        assert first.strip() == ("{" if extra else "the job hung in a collective: not every rank reached it")
        assert err == "", err  # no BrokenPipeError, no "Exception ignored"
