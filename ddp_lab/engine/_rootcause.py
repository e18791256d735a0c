"""Which rank of a failed launch failed first, and why, in words.

When one rank dies, the others fail a moment later with errors *about* the dead
rank: "Connection reset by peer", "Connection closed by peer", a timed-out
collective. Those are secondary. The rule, from what torchrun prints:

1. A primary error wins: a Python traceback whose exception (or any exception
   in its chain) is not secondary; a C++ `terminate called ...` abort that is
   not about a lost peer (a collective mismatch makes gloo abort with
   gloo::EnforceNotMet and no Python traceback); or a rank whose last words
   were "error: ..." (a program that explains itself and exits).
2. Else a rank that died on its own without a traceback: killed by a signal
   (SIGKILL from the out-of-memory killer, SIGSEGV, SIGABRT) or an exit code
   with nothing printed (os._exit(3)). "On its own" means torchrun did not stop
   it: torchrun logs "Sending process PID closing signal SIGTERM" for every rank
   still running when it noticed the failure.
3. Else the secondary errors, with the ranks that were still running (often
   the one that hung) named below the traceback.
Within a tier, torchrun's "Root Cause (first observed failure)" rank comes
first, then the lowest rank.

Why not simply trust torchrun's Root Cause block? It is the failure with the
smallest timestamp, in whole seconds, and ties go to the lowest rank. When rank
1 is SIGKILLed and rank 0 exits with "Connection reset" within the same second,
before torchrun's next poll, the block names rank 0.
"""
from __future__ import annotations

import re
import signal

# A rank that died *because another rank died* reports a broken connection or a
# timed-out collective; the rank that really failed is the one that did not.
# (Not gloo's pair.cc as such: a collective mismatch fails an enforce in pair.cc too.)
_SECONDARY = re.compile(r"Connection (reset|closed|refused)|Read error|Write error|DistBackendError|"
                        r"DistNetworkError|Broken pipe|timed out|Timeout|NCCL communicator|"
                        r"SignalException|ProcessGroup.*(abort|shut)", re.I)
_ROOT_CAUSE = "Root Cause (first observed failure):"
_BANNER_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_BANNER_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(?:\s*\(pid:\s*(\d+)\))?")
_STOPPED_BY_TORCHRUN = re.compile(r"(?:Sending process|Unable to shutdown process) (\d+)")
_TERMINATE = re.compile(r"terminate called (?:after throwing an instance of '[^']+'|without an active "
                        r"exception|recursively)")
_CHAINED = ("The above exception was the direct cause of the following exception:",
            "During handling of the above exception, another exception occurred:")
_SIGNALS = {
    "SIGKILL": "often the out-of-memory killer; check `dmesg` or the job's memory limit",
    "SIGSEGV": "a crash in native code, such as a C/C++/CUDA extension or a bad pointer",
    "SIGABRT": "a C++ abort, such as `terminate called ...` or a failed check in a library",
    "SIGBUS": "a bus error, often /dev/shm too small for DataLoader workers",
    "SIGFPE": "an arithmetic fault in native code",
    "SIGILL": "an illegal instruction: native code built for another CPU",
    "SIGTERM": "asked to stop from outside: a scheduler's time limit, preemption or `kill`",
    "SIGINT": "interrupted, as by Ctrl-C",
    "SIGHUP": "its terminal or session went away",
}
LAST_LINES = 5


def root_cause(log: str, rank_lines: dict, rank_errors: dict | None = None,
               details: dict | None = None) -> tuple[str, int | None]:
    """(message, rank) for a failed launch.

    log: everything torchrun printed; rank_lines: each rank's output; rank_errors: each
    rank's stderr alone, where tracebacks are whole (in rank_lines a print from the same
    rank can land inside one). Without it, rank_lines is searched. details, when given, gets
    "tier": "primary" (a rank's own Python error), "abort" (a C++ abort), "alone" (died
    without a traceback), "secondary" (every error is a lost peer or a timeout) or "none".
    """
    details = {} if details is None else details
    details["tier"] = "none"
    errors = rank_errors if rank_errors is not None else rank_lines
    exits, root, stopped = _torchrun_report(log)
    primary, alone, secondary = [], [], []
    for r in sorted(set(rank_lines) | set(errors)):
        first = _first_error(errors.get(r, []))
        if first is not None:
            (primary if first[0] == "primary" else secondary).append(r)
        elif exits.get(r, 0) > 0 and (said := _said_error(rank_lines.get(r, []))) \
                and not _SECONDARY.search(said):
            primary.append(r)  # exited with a message of its own
    for r, code in exits.items():
        if r not in primary and r not in secondary and code != 0 and r not in stopped:
            alone.append(r)
    def first_observed(r):  # within a tier: torchrun's pick, then the lowest rank
        return r != root, r

    if primary:
        r = min(primary, key=lambda r: (_first_error(errors.get(r, [])) is None, *first_observed(r)))
        first = _first_error(errors.get(r, []))
        details["tier"] = "abort" if first is not None and _TERMINATE.match(first[1]) else "primary"
        return _primary_message(r, rank_lines.get(r, []), errors.get(r, []), exits.get(r)), r
    if alone:
        r = min(alone, key=first_observed)
        details["tier"] = "alone"
        return _death_message(r, exits[r], rank_lines.get(r, [])), r
    if secondary:
        r = min(secondary, key=first_observed)
        details["tier"] = "secondary"
        _, exc_line, text = _first_error(errors[r])
        running = [f"rank {s} was still running when torchrun stopped it; its last output: "
                   f"{(_last(rank_lines.get(s, []), 1) or ['nothing'])[0]!r}"
                   for s in sorted(stopped) if s != r]
        note = ("\n\nEvery error above reports a lost peer or a timeout, a consequence of another "
                "rank stopping or hanging." + "".join("\n" + line for line in running))
        return f"rank {r} failed: {exc_line}\n\n{text}{note}", r
    if root is not None and root in exits:
        return _death_message(root, exits[root], rank_lines.get(root, [])), root
    last = "\n".join(log.strip().splitlines()[-15:])
    return f"launch failed; last lines of the log:\n{last}", None


def _torchrun_report(log: str):
    """Each failed rank's exit code, the Root Cause rank, and the ranks torchrun itself stopped."""
    exits, pids, root, rank, in_root = {}, {}, None, None, False
    for line in log.splitlines():
        if _ROOT_CAUSE in line:
            in_root = True
        elif m := _BANNER_RANK.match(line):
            rank = int(m.group(1))
            if in_root and root is None:
                root = rank
        elif (m := _BANNER_EXIT.match(line)) and rank is not None:
            exits[rank] = int(m.group(1))
            if m.group(2):
                pids[int(m.group(2))] = rank
            rank = None
    stopped = {pids[int(p)] for p in _STOPPED_BY_TORCHRUN.findall(log) if int(p) in pids}
    return exits, root, stopped


def _first_error(lines: list[str]):
    """("primary" | "secondary", headline, text) for the first error a rank reported, or None.

    The first, because a rank that lost its peer may abort later on its way out
    ("terminate called without an active exception"): that abort is not its cause.
    """
    tb_at = next((i for i, l in enumerate(lines) if l.strip() == "Traceback (most recent call last):"), None)
    cpp_at = next((i for i, l in enumerate(lines) if _TERMINATE.search(l)), None)
    if cpp_at is not None and (tb_at is None or cpp_at < tb_at):
        what = next((l.split("what():", 1)[1].strip() for l in lines[cpp_at + 1:cpp_at + 6]
                     if "what():" in l), "")
        kind = "secondary" if _SECONDARY.search(what) else "primary"
        headline = _TERMINATE.search(lines[cpp_at]).group(0) + (f": {what}" if what else "")
        return kind, headline, lines[cpp_at]  # the line itself: its context is in the prints
    found = _last_traceback(lines)
    if found is None:
        return None
    exc_lines, text = found
    kind = "secondary" if any(_SECONDARY.search(e) for e in exc_lines) else "primary"
    return kind, exc_lines[-1], text


def _last_traceback(lines: list[str]):
    """([exception line of each chained traceback], text) for the last exception a rank printed."""
    starts = [i for i, l in enumerate(lines) if l.strip() == "Traceback (most recent call last):"]
    if not starts:
        return None
    # Chained exceptions print several tracebacks joined by a sentence; take the whole chain.
    chain = [starts[-1]]
    for s in reversed(starts[:-1]):
        before = [l.strip() for l in lines[s:chain[0]] if l.strip()]
        if before[-1] not in _CHAINED:
            break
        chain.insert(0, s)
    exc_lines, end = [], None
    for s in chain:
        exc_i = next((i for i in range(s + 1, len(lines)) if lines[i] and not lines[i].startswith(" ")), None)
        if exc_i is not None:
            exc_lines.append(lines[exc_i].strip())
            end = exc_i
    if end is None:
        return None
    return exc_lines, "\n".join(lines[chain[0]:end + 1])


def _said_error(lines: list[str]) -> str | None:
    """The last line, when it is the program's own "error: ..." message."""
    last = _last(lines, 1)
    return last[0] if last and last[0].lower().startswith("error") else None


def _primary_message(r: int, lines: list[str], errors: list[str], code: int | None) -> str:
    first = _first_error(errors)
    if first is None:  # it said "error: ..." and exited
        return f"rank {r} exited with code {code}: {_said_error(lines)}"
    _, headline, text = first
    if _TERMINATE.match(headline):  # no Python traceback: an uncaught C++ exception aborted it
        hint = ("\nThe ranks disagree on which collective comes next: one rank skipped or added "
                "one, or the sizes differ." if "mismatch" in headline else "")
        how = f" (exit code {code}{_signal_name(code)})" if code is not None else ""
        before = lines[:lines.index(text)] if text in lines else lines
        return (f"rank {r} failed: C++ abort: {headline}{hint}\n\n"
                f"Last lines of rank {r} before it aborted{how}:\n{_indented(_last(before, LAST_LINES))}")
    return f"rank {r} failed: {headline}\n\n{text}"


def _death_message(r: int, code: int, lines: list[str]) -> str:
    return f"rank {r} {_in_words(code)}. Last lines of rank {r}:\n{_indented(_last(lines, LAST_LINES))}"


def _in_words(code: int) -> str:
    if code < 0:
        name = _signal_name(code)[2:] or f"signal {-code}"
        meaning = _SIGNALS.get(name)
        return f"was killed by {name}" + (f": {meaning}" if meaning else "") + f" (exit code {code})"
    return f"exited with code {code} without a traceback (os._exit, or native code that ended the process)"


def _signal_name(code: int) -> str:
    """", SIGKILL" for exit code -9; "" when the code is not a signal."""
    try:
        return ", " + signal.Signals(-code).name if code < 0 else ""
    except ValueError:
        return ""


def _indented(lines: list[str]) -> str:
    return "\n".join("    " + l for l in lines) if lines else "    (nothing)"


def _last(lines: list[str], n: int) -> list[str]:
    """The last n non-blank lines."""
    return [l.rstrip() for l in lines if l.strip()][-n:]
