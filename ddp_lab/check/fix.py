"""`ddp-lab check --fix`: the findings that have one safe rewrite, rewritten in place.

Each fixer turns one finding into text edits at the finding's location; the rest of the file stays
byte for byte as it was. A rewrite that would leave a Python file unparseable is dropped, and a
file the checker could not read or parse is never touched. Notebooks are not rewritten.

    DDP007  sampler.set_epoch(epoch) as the first line of the epoch loop (the sampler's name known)
    DDP012  torch.cuda.amp.autocast(...) -> torch.amp.autocast("cuda", ...), the same for GradScaler
    DDP015  model.state_dict() -> model.module.state_dict() on the DDP wrapper
    DDP101  a `# comment` after a continuing backslash moved above the command
"""
from __future__ import annotations

import ast
import difflib
import io
import os
import re
import shutil
import tempfile
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

from .astutil import key, last
from .files import kind_of
from .pyfacts import Module

AMP = re.compile(r"^torch\.(cuda|cpu)\.amp\.(autocast|GradScaler)$")
EPOCHISH = re.compile(r"epoch", re.I)
BROKEN_CONTINUATION = re.compile(r"\\[ \t]+(#.*)?$")


@dataclass
class Edit:
    start: int      # character offsets into the file's text
    end: int
    text: str


@dataclass
class Plan:
    """What --fix would do to one file."""
    path: str
    old: str
    new: str
    encoding: str
    fixed: list = field(default_factory=list)   # the findings the edits fix


class Text:
    """A file's text with (line, column) -> offset; AST columns count UTF-8 bytes."""

    def __init__(self, text: str):
        self.text = text
        self.lines = re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$", text)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, line: int, byte_col: int) -> int:
        raw = self.lines[line - 1].encode("utf-8")[:byte_col]
        return self.starts[line - 1] + len(raw.decode("utf-8", errors="ignore"))

    def bare(self, line: int) -> str:
        return self.lines[line - 1].rstrip("\r\n")


def _node_at(tree, line: int, col: int, kind, wanted=lambda n: True):
    """The node of this kind starting at the finding's place that wanted() accepts (an attribute
    chain or a call chain has several nodes starting at one place)."""
    return next((n for n in ast.walk(tree) if isinstance(n, kind) and n.lineno == line and n.col_offset == col - 1
                 and wanted(n)), None)


# ------------------------------------------------------------ Python fixers
def _amp(text: Text, m: Module, finding) -> list[Edit]:
    func = _node_at(m.tree, finding.line, finding.col, ast.Attribute, lambda n: AMP.match(ast.unparse(n)))
    call = m.parent.get(func)
    match = AMP.match(ast.unparse(func)) if func is not None else None
    if not (match and isinstance(call, ast.Call) and call.func is func and func.lineno == func.end_lineno):
        return []
    device, what = match.groups()
    if what == "autocast" and call.args:   # positional `enabled` comes after device_type in torch.amp
        return []
    end = text.offset(func.end_lineno, func.end_col_offset)
    paren = re.match(r"\s*\(", text.text[end:])
    if paren is None:
        return []
    has_args = bool(call.args or call.keywords)
    return [Edit(text.offset(func.lineno, func.col_offset), end, f"torch.amp.{what}"),
            Edit(end + paren.end(), end + paren.end(), f'"{device}"' + (", " if has_args else ""))]


def _module_state_dict(text: Text, m: Module, finding) -> list[Edit]:
    call = _node_at(m.tree, finding.line, finding.col, ast.Call,
                    lambda n: isinstance(n.func, ast.Attribute) and n.func.attr == "state_dict")
    if call is None:
        return []
    owner = call.func.value
    at = text.offset(owner.end_lineno, owner.end_col_offset)
    return [Edit(at, at, ".module")]


def _set_epoch(text: Text, m: Module, finding) -> list[Edit]:
    loop = _node_at(m.tree, finding.line, finding.col, (ast.For, ast.While))
    if loop is None or loop.body[0].lineno == loop.lineno:
        return []
    names = [n.id for n in ast.walk(loop.target if isinstance(loop, ast.For) else loop.test)
             if isinstance(n, ast.Name) and EPOCHISH.search(n.id)]
    if isinstance(loop, ast.For) and not names and isinstance(loop.target, ast.Name):
        names = [loop.target.id]
    samplers = {key(t) for n in m.nodes if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                and m.is_sampler(n.value) and len(n.targets) == 1
                and _visible(m, n, loop) for t in n.targets}
    if len(set(names)) != 1 or len(samplers) != 1 or None in samplers:
        return []
    first = loop.body[0].lineno
    line = text.lines[first - 1]
    indent = line[:len(line) - len(line.lstrip(" \t"))]
    newline = line[len(line.rstrip("\r\n")):] or "\n"
    return [Edit(text.starts[first - 1], text.starts[first - 1],
                 f"{indent}{samplers.pop()}.set_epoch({names[0]}){newline}")]


def _visible(m: Module, assign: ast.Assign, loop) -> bool:
    """The sampler's name means the same object inside the loop."""
    k = key(assign.targets[0])
    if k is None:
        return False
    if k.startswith("self."):
        cls = [a for a in m.ancestors(assign) if isinstance(a, ast.ClassDef)][:1]
        return bool(cls) and cls[0] in set(m.ancestors(loop))
    return m.scope(assign) in (m.scope(loop), m.tree) and assign.lineno < loop.lineno


PYTHON_FIXERS = {"DDP007": _set_epoch, "DDP012": _amp, "DDP015": _module_state_dict}


# ------------------------------------------------------------ shell fixer
def _comment_after_backslash(text: Text, findings) -> tuple[list[Edit], list]:
    edits, fixed, above = [], [], {}
    for f in findings:
        line = text.bare(f.line)
        if f.col < 1 or line[f.col - 1:f.col] != "\\" or not BROKEN_CONTINUATION.fullmatch(line[f.col - 1:]):
            continue
        start = f.line
        while start > 1 and (text.bare(start - 1).endswith("\\") or BROKEN_CONTINUATION.search(text.bare(start - 1))):
            start -= 1
        cut = text.starts[f.line - 1] + f.col   # just after the backslash
        edits.append(Edit(cut, text.starts[f.line - 1] + len(line), ""))
        comment = line[f.col:].strip().lstrip("#").strip()
        if comment:
            first = text.bare(start)
            indent = first[:len(first) - len(first.lstrip(" \t"))]
            newline = text.lines[start - 1][len(first):] or "\n"
            above.setdefault(start, []).append(f"{indent}# {line[:f.col - 1].strip()}: {comment}{newline}")
        fixed.append(f)
    for start, comments in above.items():
        edits.append(Edit(text.starts[start - 1], text.starts[start - 1], "".join(comments)))
    return edits, fixed


# ------------------------------------------------------------ planning, diffs, writing
def apply(text: str, edits: list[Edit]) -> str:
    for e in sorted(edits, key=lambda e: (e.start, e.end), reverse=True):
        text = text[:e.start] + e.text + text[e.end:]
    return text


def _read(path: Path, kind: str) -> tuple[str, str]:
    data = path.read_bytes()
    encoding = tokenize.detect_encoding(io.BytesIO(data).readline)[0] if kind == "python" else "utf-8"
    return data.decode(encoding), encoding


def plan_file(path, findings) -> Plan | None:
    """The rewrite of one file for its findings (all from check_file on this path), or None when
    none of them has a safe rewrite. Raises ValueError when the rewritten file would not parse."""
    path = Path(path)
    kind = kind_of(path)
    findings = [f for f in findings if f.cell is None]
    if kind not in ("python", "shell") or not findings:
        return None
    old, encoding = _read(path, kind)
    text, edits, fixed = Text(old), [], []
    if kind == "python":
        m = Module(ast.parse(old), old)
        for f in findings:
            new_edits = PYTHON_FIXERS[f.id](text, m, f) if f.id in PYTHON_FIXERS else []
            if new_edits and not any(_overlap(e, d) for e in new_edits for d in edits):
                edits += new_edits
                fixed.append(f)
    else:
        edits, fixed = _comment_after_backslash(text, [f for f in findings if f.id == "DDP101"])
    if not edits:
        return None
    new = apply(old, edits)
    if kind == "python":
        try:
            ast.parse(new)
        except SyntaxError as e:
            raise ValueError(f"the rewrite would not parse ({e.msg}, line {e.lineno}); nothing changed") from None
    return Plan(str(path), old, new, encoding, fixed)


def _overlap(a: Edit, b: Edit) -> bool:
    return a.start < b.end and b.start < a.end or (a.start == a.end == b.start == b.end)


def plan(findings) -> tuple[list[Plan], list[tuple[str, str]]]:
    """Plans for every file with a fixable finding, and (path, why) for files left alone."""
    by_path: dict = {}
    for f in findings:
        by_path.setdefault(f.path, []).append(f)
    plans, errors = [], []
    for path, found in by_path.items():
        try:
            p = plan_file(path, found)
        except (ValueError, OSError, UnicodeDecodeError, SyntaxError) as e:
            errors.append((path, f"not fixed: {e}"))
            continue
        if p is not None:
            plans.append(p)
    return plans, errors


def diff(p: Plan) -> str:
    """A unified diff, `a/path` and `b/path` for relative paths as git writes them (patch -p1 applies it)."""
    old, new = (p.path, p.path) if Path(p.path).is_absolute() else (f"a/{p.path}", f"b/{p.path}")
    return "".join(difflib.unified_diff(p.old.splitlines(keepends=True), p.new.splitlines(keepends=True),
                                        fromfile=old, tofile=new))


def write(p: Plan) -> None:
    """Replace the file in one step (a temporary file beside it, then os.replace), keeping its mode."""
    target = Path(p.path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(p.new.encode(p.encoding))
        shutil.copymode(target, tmp)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
