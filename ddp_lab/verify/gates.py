"""The script's own line that keeps work from all ranks but one, for a finding's fix to quote.

    rank_gate("train.py", prefer={"step"})   # (41, "if dist.get_rank() != 0:") or None

An `if` whose test names the rank (rank, get_rank(), is_main...) counts when it holds a call
other than logging and saving, or when it leaves early (`return`, `continue`, `break`) before
such a call in the same block. A fix names the line it found, never code the script does not have.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize

_RANK = re.compile(r"rank|is_main|is_master|main_process|is_primary|is_leader", re.I)
# what one rank may do alone: logging, printing, saving, progress
_HARMLESS = {"print", "info", "debug", "warning", "warn", "error", "exception", "log", "save", "write",
             "flush", "makedirs", "mkdir", "dump", "dumps", "add_scalar", "add_scalars", "close", "format",
             "item", "set_description", "set_postfix", "state_dict", "tolist", "str", "len", "round"}


def parsed(path: str):
    """(syntax tree, lines) of a script, or None when it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return ast.parse(text), text.splitlines()
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
        return None


def rank_gate(path: str, prefer=frozenset()) -> tuple[int, str] | None:
    """(line, code) of the first rank condition that keeps a call in `prefer` from the other ranks,
    else of the first that keeps any call but logging and saving from them; None when there is none."""
    if (found := parsed(path)) is None:
        return None
    tree, lines = found
    other = None
    for node in ast.walk(tree):
        for block in (getattr(node, name, None) for name in ("body", "orelse", "finalbody")):
            if not isinstance(block, list):
                continue
            for k, st in enumerate(block):
                if not isinstance(st, ast.If) or not _RANK.search(ast.unparse(st.test)):
                    continue
                leaves = bool(st.body) and isinstance(st.body[-1], (ast.Return, ast.Continue, ast.Break))
                kept = _calls(block[k + 1:] if leaves else st.body)
                code = _line(lines, st.lineno)
                if kept & set(prefer):
                    return st.lineno, code
                if other is None and kept - _HARMLESS:
                    other = (st.lineno, code)
    return other


def _line(lines, lineno) -> str:
    """The source line as the script has it, without a trailing `# comment`."""
    line = lines[lineno - 1] if 0 < lineno <= len(lines) else ""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line).readline):
            if tok.type == tokenize.COMMENT:
                return line[:tok.start[1]].strip()
    except (tokenize.TokenError, SyntaxError):
        pass
    return line.strip()


def _calls(statements) -> set:
    out = set()
    for st in statements:
        for n in ast.walk(st):
            if isinstance(n, ast.Call):
                f = n.func
                out.add(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
    return out


def quoted(at: str | None, prefer=frozenset()) -> str | None:
    """"train.py:41 `if dist.get_rank() != 0:`" for the script of a finding's line ("path:line")."""
    if not at or ":" not in at:
        return None
    path = at.rsplit(":", 1)[0]
    found = rank_gate(path, prefer)
    if found is None:
        return None
    return f"{path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{found[0]} `{found[1]}`"
