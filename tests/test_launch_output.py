"""What a launch shows: readable lines, a bounded amount of them, never at the job's expense."""
import re
import sys
import time

import pytest

from conftest import PROGRAMS
from ddp_lab.engine import launch

CHATTY = PROGRAMS / "chatty.py"


class SlowKernel:
    """Stands in for a busy notebook kernel: every write to the cell's output takes 0.2 s."""

    def __init__(self):
        self.text = []

    def write(self, s):
        time.sleep(0.2)
        self.text.append(s)
        return len(s)

    def flush(self):
        pass

    def lines(self):
        return "".join(self.text).splitlines()


def test_a_slow_display_neither_stalls_nor_times_out_the_job(monkeypatch):
    # 2 x 20,000 lines: shown one write per line, this display would need over two hours.
    n = 20_000
    kernel = SlowKernel()
    monkeypatch.setattr(sys, "stdout", kernel)
    run = launch.torchrun(CHATTY, nproc=2, args=["many", n], timeout=90)
    shown = kernel.lines()
    monkeypatch.undo()
    assert run.returncode == 0
    # Every line is kept...
    for rank in (0, 1):
        assert run.rank_lines[rank] == [f"line {rank} {i}" for i in range(n)]
    assert run.log.count("\n") >= 2 * n
    # ...but only a bounded part is shown, and the reader is told where the rest is.
    worker_lines = [line for line in shown if line.startswith("[rank ")]
    assert len(worker_lines) == launch.SHOW_HEAD + launch.SHOW_TAIL
    hidden = 2 * n - len(worker_lines)
    assert f"... {hidden:,} lines not shown; the full log is in run.log" in shown
    # After the marker come the job's last lines, in the order they arrived.
    marker_at = shown.index(f"... {hidden:,} lines not shown; the full log is in run.log")
    last = [re.sub(r"^\[(\d)\]:", r"[rank \1] ", line) for line in run.log.splitlines()
            if re.match(r"\[\d\]:line", line)][-launch.SHOW_TAIL:]
    assert shown[marker_at + 1:] == last
    assert shown[:launch.SHOW_HEAD] == worker_lines[:launch.SHOW_HEAD]  # the first lines, live


def test_output_without_a_newline_is_not_glued_to_another_ranks_line(capsys):
    # Rank 1 leaves an input() prompt and a "\r" progress bar without a newline while
    # rank 0 prints whole lines: torchrun writes them into the same stream.
    run = launch.torchrun(CHATTY, nproc=2, args=["partial"], timeout=90)
    shown = capsys.readouterr().out.splitlines()
    assert run.returncode == 0
    worker = [line for line in shown if line.startswith("[rank ")]
    assert worker and all(re.fullmatch(r"\[rank [01]\] \S.*", line) for line in worker), worker
    assert not [line for line in shown if re.search(r"\[\d\]:|<ddp-lab-", line)]
    rank0 = [line for line in worker if line.startswith("[rank 0] ")]
    assert sorted(rank0) == sorted([f"[rank 0] step {i}" for i in range(25)]
                                   + [f"[rank 0] check {i}" for i in range(25)])
    rank1 = " | ".join(line for line in worker if line.startswith("[rank 1] "))
    for said in ("name?", "no input", "10%|#", "20%|##", "30%|###"):
        assert said in rank1, rank1


def test_a_failure_streams_no_empty_rank_lines(capsys):
    with pytest.raises(launch.LaunchError):
        launch.torchrun(PROGRAMS / "fail_rank.py", nproc=2, env={"DDP_LAB_TIMEOUT": "20"}, timeout=120)
    shown = capsys.readouterr().out.splitlines()
    assert any(line.startswith("[rank 1] ValueError: shard 7 is corrupt") for line in shown)
    assert not [line for line in shown if re.fullmatch(r"\[rank \d+\]\s*", line)]


def test_a_bare_name_means_the_workbooks_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert launch._program_argv("train_ddp.py --epochs 1") == [launch.script("train_ddp.py"), "--epochs", "1"]
    # A file of that name in the current folder comes first.
    (tmp_path / "train_ddp.py").write_text("print('mine')\n")
    assert launch._program_argv("train_ddp.py") == [str(tmp_path / "train_ddp.py")]


@pytest.mark.parametrize("program", ["myproj/train_ddp.py", "./minimal_ddp.py"])
def test_a_wrong_path_is_an_error_not_the_workbooks_script(tmp_path, monkeypatch, program):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        launch.torchrun(program, nproc=2, stream=False)
    message = str(info.value)
    assert f"no such program: {program}" in message
    assert str(tmp_path) in message  # the folder the path was resolved against


def test_an_interrupted_launch_renders_as_one_line_in_a_notebook():
    # IPython shows _render_traceback_() instead of the traceback through queue.py and threading.py
    err = launch.LaunchInterrupted("the launch was stopped")
    assert isinstance(err, KeyboardInterrupt)  # the cell, and Run All, still stop
    assert err._render_traceback_() == ["LaunchInterrupted: the launch was stopped"]


def test_a_stop_after_the_job_finished_says_so_and_keeps_the_result(monkeypatch):
    # The stop button pressed while the launcher tidies up after the last rank exited: the job's
    # output is complete (every pipe closed), so the first output.close() is where the stop lands.
    close = launch._Output.close
    stops = []

    def stopped_once(self):
        if not stops:
            stops.append(True)
            raise KeyboardInterrupt
        return close(self)

    monkeypatch.setattr(launch._Output, "close", stopped_once)
    with pytest.raises(launch.LaunchInterrupted) as info:
        launch.torchrun(PROGRAMS / "env_report.py", nproc=2, stream=False, timeout=120)
    message = str(info.value)
    assert "had already finished (exit status 0)" in message and "result stands" in message
    assert "was stopped, and every process" not in message
    assert len(info.value.run.select(kind="env")) == 2  # both ranks' records, read before the tidy-up


def test_a_stop_during_the_job_says_it_was_stopped(monkeypatch):
    def stop(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch.queue.Queue, "get", stop)  # the stop lands while the launcher waits on output
    with pytest.raises(launch.LaunchInterrupted) as info:
        launch.torchrun(PROGRAMS / "env_report.py", nproc=2, stream=False, timeout=120)
    assert str(info.value) == "the launch was stopped, and every process it started with it"
    assert info.value.run is None
