"""%%px for the persistent ranks (ddp_lab.engine.interactive): each rank's error once, and every line.

ipyparallel's own %%px streams a rank's traceback as it happens and then, when the reply beats
the rest of the output (it travels on another channel), raises a CompositeError that prints every
traceback again. It also stops streaming as soon as the reply or the stop button comes, so a line
a rank printed just before either is lost; and after the stop button the cell ends as if it had
run, so `Run All` goes on. Here a blocking, streaming %%px waits for the ranks' output before the
cell ends, shows each rank's error once (streamed as it happens, in the short plain form the
ranks are set to) and ends in one line: a RanksError naming the ranks that failed, or
RanksInterrupted after the stop button. `--noblock` and `--no-stream` behave as ipyparallel's.
"""
from __future__ import annotations

import sys
import threading
import time

from ipyparallel.client.magics import ParallelMagics

from ddp_lab.engine.interactive import OUTPUT_WAIT_S, RanksError


class FailedOnRanks(RanksError):
    """A %%px cell raised on some ranks; their tracebacks were streamed above, once each."""

    def __init__(self, error: RanksError, shown: set):
        super().__init__(str(error), error.errors)
        self.shown = shown  # filled as the ranks' errors arrive, which can be after the reply

    def _render_traceback_(self):  # IPython shows these lines instead of a traceback
        ranks = sorted({r for r, _ in self.errors})
        where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        above = " (traceback above)" if set(ranks) <= self.shown else ""
        return ([f"RanksError: the cell failed on {where}{above}"]
                + [f"rank {r}: {line}" for r, line in self.errors if r not in self.shown])


class RankMagics(ParallelMagics):
    """%px, %%px, %autopx, %pxconfig and %pxresult on `ranks`, with %%px as described above."""

    def __init__(self, shell, ranks):
        self.ranks = ranks
        super().__init__(shell, ranks.view)

    def parallel_execute(self, cell, block=None, groupby="type", save_name=None, stream_output=None,
                         progress_after=None, signal_on_interrupt=None):
        block = self.view.block if block is None else block
        stream = self.stream_output if stream_output is None else stream_output
        if not (block and stream):
            return super().parallel_execute(cell, block, groupby, save_name, stream_output,
                                            progress_after, signal_on_interrupt)
        self.ranks._check()
        result = self.view.execute(cell, silent=False, block=False)
        result._fname = "%px"
        self.last_result = result
        if save_name:
            self.shell.user_ns[save_name] = result
        shown = stream_errors_once(result)
        with result.stream_output():
            replay_errors(result, shown)
            try:
                self.ranks._wait(result)  # the stop button: RanksInterrupted, after the last lines
            except RanksError as e:
                # The reply can beat a failed rank's error on IOPub (seen once, under load: the error
                # was then printed short and the rank's traceback lost): wait until each has streamed
                streamed = {r for r, line in e.errors if not line.startswith("KeyboardInterrupt")}
                deadline = time.monotonic() + OUTPUT_WAIT_S
                while not streamed <= shown and time.monotonic() < deadline:
                    time.sleep(0.05)
                raise FailedOnRanks(e, shown) from None
            finally:
                if result.ready():        # the reply came; the lines printed last may not have
                    result.wait_for_output(OUTPUT_WAIT_S)


_SHOWING = threading.Lock()  # ipyparallel's thread streams, this one replays: one shows each error


def stream_errors_once(result) -> set:
    """Have ipyparallel stream each rank's error as it comes, except a stopped cell's
    KeyboardInterrupt (RanksInterrupted says it in one line); returns the engine ids shown."""
    shown = set()
    stream = result._iopub_streaming_output_callback  # what stream_output() registers per engine

    def callback(eid, future, msg):
        if msg["header"]["msg_type"] == "error":
            if msg["content"].get("ename") == "KeyboardInterrupt":
                return
            with _SHOWING:
                if eid in shown:
                    return
                shown.add(eid)
        stream(eid, future, msg)
    result._iopub_streaming_output_callback = callback
    return shown


def replay_errors(result, shown: set) -> None:
    """stream_output() replays what a rank printed before it was entered, but not a rank's error:
    a rank that failed that fast (`1 / 0` at once, seen under load) had its traceback lost and the
    cell waited OUTPUT_WAIT_S for it. Print such errors here, once, as the stream would have."""
    for eid, future in zip(result._targets, result._children):
        err = future.output.metadata.get("error")
        if err is None or getattr(err, "ename", "") == "KeyboardInterrupt":
            continue
        with _SHOWING:
            if eid in shown:
                continue
            shown.add(eid)
        print("\n".join(err.render_traceback()), file=sys.stderr)
