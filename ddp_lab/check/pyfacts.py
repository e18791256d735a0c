"""What the Python rules ask about a module: scopes, bindings, callers, DDP-wrapped names
(rank checks and guards come from ranks.RankFacts).

Everything here reads the AST; nothing imports or runs the user's code. Answers lean to
"don't know" (no finding) whenever the code leaves room for doubt.
"""
from __future__ import annotations

import ast
import os
import re

from .astutil import dotted, is_ddp_call, key, last, pairs
from .flow import Flow
from .ranks import RankFacts
from .structure import COLLECTIVES, imports, sampler_classes  # noqa: F401  (rules import COLLECTIVES here)

# A file that talks about DDP at all. Rules whose pattern is also fine in single-process code
# (gradient accumulation, torch.save on "every rank") only run in such files.
DDP_TEXT = re.compile(r"\bDDP\b|DistributedDataParallel|torch\.distributed|init_process_group|no_sync"
                      r"|DistributedSampler|LOCAL_RANK|torchrun|FullyShardedDataParallel|\bFSDP\b")
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Module)
DISTRIBUTED_CALLS = {"init_process_group", "DDP", "DistributedDataParallel", "FullyShardedDataParallel", "FSDP",
                     "fully_shard", "DistributedSampler", "spawn"}


class Module(RankFacts):
    def __init__(self, tree: ast.Module, text: str, parent: dict | None = None, project=None, path: str | None = None):
        """parent, project, path: given when several files are checked together (imports.Project),
        whose modules share one parent table so that a node of any of them has its ancestors."""
        self.tree, self.text = tree, text
        self.parent: dict = {} if parent is None else parent
        self.project, self.path = project, path
        self._imports = self._toplevel = None   # imports.Project's tables for this file
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self.nodes = list(ast.walk(tree))
        self.calls = [n for n in self.nodes if isinstance(n, ast.Call)]
        self._callers: dict = {}
        self._assignments: dict = {}
        self.is_ddp = bool(DDP_TEXT.search(text))
        self.multiprocess = True   # False for a notebook's kernel: one process, whatever it imports
        self.uses_cuda = bool(re.search(r"\bcuda\b|device_ids|nccl", text))
        # It starts or joins a process group, wraps a model, or reads who it is: a program run N times.
        self.runs_distributed = any(last(c) in DISTRIBUTED_CALLS for c in self.calls) or any(
            isinstance(n, ast.Constant) and n.value in ("RANK", "LOCAL_RANK", "WORLD_SIZE") for n in self.nodes)
        self.imported = imports(self.nodes)   # local name -> full dotted name (structure.py)
        self.samplers = sampler_classes(self.nodes, self.imported)   # DistributedSampler and its subclasses here
        self.aliases = self._aliases()
        self._flow = None

    @property
    def flow(self) -> Flow:
        """Calls followed into this file's functions, exclusive branches, guards (flow.py)."""
        if self._flow is None:
            self._flow = Flow(self)
        return self._flow

    def owner(self, node) -> "Module":
        """The module (this one, or another file checked with it) that holds node."""
        return self if self.project is None else self.project.module_of(node) or self

    def where(self, node) -> str:
        """`line 12`, or `utils.py line 12` for a node of another file."""
        owner = self.owner(node)
        if owner is self:
            return f"line {node.lineno}"
        return f"{os.path.relpath(owner.path, os.path.dirname(self.path))} line {node.lineno}"

    def is_sampler(self, call) -> bool:
        """call builds a DistributedSampler (or a class of this file derived from it)."""
        return isinstance(call, ast.Call) and last(call) in self.samplers

    # ------------------------------------------------------------ structure
    def ancestors(self, node):
        while node in self.parent:
            node = self.parent[node]
            yield node

    def scope(self, node):
        return next(a for a in self.ancestors(node) if isinstance(a, SCOPES))

    def function(self, node):
        return next((a for a in self.ancestors(node) if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef))), None)

    def walk_scope(self, scope):
        """Nodes of one scope, not of the functions and classes defined inside it."""
        todo = list(ast.iter_child_nodes(scope))
        while todo:
            node = todo.pop()
            yield node
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                todo.extend(ast.iter_child_nodes(node))

    def statement(self, node):
        return node if isinstance(node, ast.stmt) else next(a for a in self.ancestors(node) if isinstance(a, ast.stmt))

    def branches(self, node):
        """(if-node, in_body) for every if around node, innermost first, up to its function."""
        child = node
        for a in self.ancestors(node):
            if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                return
            if isinstance(a, (ast.If, ast.IfExp)) and child is not a.test:
                body = a.body if isinstance(a.body, list) else [a.body]
                yield a, any(child is s for s in body)
            child = a

    def assignments(self, scope, name: str) -> list[tuple[int, ast.AST | None, ast.AST]]:
        """(line, value, binding node) for every binding of `name` in scope, in line order; value is
        None where it cannot be told (a loop or with target, `a, b = f()`)."""
        if id(scope) not in self._assignments:   # every name of the scope in one walk
            found: dict = {}
            for node in self.walk_scope(scope):
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        for k, v in pairs(t, node.value):
                            found.setdefault(k, []).append((node.lineno, v, node))
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    found.setdefault(key(node.target), []).append((node.lineno, node.value, node))
                elif isinstance(node, (ast.For, ast.AsyncFor)):
                    for k in {key(n) for n in ast.walk(node.target)}:
                        found.setdefault(k, []).append((node.lineno, None, node))
                elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                    found.setdefault(key(node.optional_vars), []).append(
                        (node.optional_vars.lineno, None, node.optional_vars))
            self._assignments[id(scope)] = {k: sorted(v, key=lambda p: p[0]) for k, v in found.items()}
        return self._assignments[id(scope)].get(name, [])

    # ------------------------------------------------------------ calls into helpers
    def callers(self, func) -> list:
        """Calls of a module function (`f(...)`, or `f` handed to mp.spawn and the like), or of a
        method (`self.f(...)`, `obj.f(...)` where obj = ThisClass(...))."""
        if func not in self._callers:
            self._callers[func] = self._find_callers(func)
        return self._callers[func]

    def _find_callers(self, func) -> list:
        cls = self.parent.get(func)
        if isinstance(cls, ast.ClassDef):
            instances = {k for n in self.nodes if isinstance(n, ast.Assign)
                         and isinstance(n.value, ast.Call) and last(n.value) == cls.name
                         for k in map(key, n.targets) if k}
            out = [c for c in self.calls if isinstance(c.func, ast.Attribute) and c.func.attr == func.name
                   and (key(c.func.value) == "self" or dotted(c.func.value) in instances)]
        else:
            out = [c for c in self.calls if isinstance(c.func, ast.Name) and c.func.id == func.name]
            out += [a for c in self.calls for a in [*c.args, *(k.value for k in c.keywords)]
                    if isinstance(a, ast.Name) and a.id == func.name]
        return [c for c in out if func not in set(self.ancestors(c))]

    def every_rank_path(self, node, depth: int = 0) -> ast.AST | None:
        """An unguarded place from which node runs on every rank (node itself, or a call into its
        function), or None when a rank check guards it or no caller in this file is known."""
        if self.guarded(node):
            return None
        func = self.function(node)
        if func is None:
            return node
        if depth > 4:
            return None
        for call in self.callers(func):
            if self.every_rank_path(call, depth + 1) is not None:
                return call
        return None

    # ------------------------------------------------------------ DDP-wrapped names
    def wrapped(self, expr, at, depth: int = 0) -> bool:
        """Is expr (`model`, `self.model`) a DDP wrapper where `at` runs?"""
        k = key(expr)
        if k is None or depth > 4:
            return False
        if k.startswith("self."):
            cls = next((a for a in self.ancestors(at) if isinstance(a, ast.ClassDef)), None)
            return cls is not None and any(
                isinstance(n, ast.Assign) and any(key(t) == k for t in n.targets) and _has_ddp(n.value)
                for n in ast.walk(cls))
        before = [(line, v) for line, v, _ in self.assignments(self.scope(at), k) if line < at.lineno]
        if not before or before[-1][1] is None:
            return False
        return self._still_wrapped(before[-1][1], k, depth)

    def _still_wrapped(self, value, k: str, depth: int) -> bool:
        """value is a DDP(...) call, or hands on a wrapper: `ddp_model`, `torch.compile(ddp_model)`,
        `ddp_model.to(device)`, `a if c else b`."""
        if is_ddp_call(value):
            return True
        if isinstance(value, ast.IfExp):  # `m.module if ddp else m` unwraps; `DDP(m) if ddp else m` may wrap
            sides = (value.body, value.orelse)
            return not any(isinstance(v, ast.Attribute) and v.attr == "module" for v in sides) and \
                any(self._still_wrapped(v, k, depth) for v in sides)
        if isinstance(value, ast.Call) and last(value) in ("compile", "to", "cuda", "half", "float", "bfloat16"):
            inner = value.func.value if isinstance(value.func, ast.Attribute) and last(value) != "compile" else \
                value.args[0] if value.args else None
            return inner is not None and self._still_wrapped(inner, k, depth)
        func = self.flow.target(value) if isinstance(value, ast.Call) and depth < 4 else None
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) and self.owner(func) is self:
            # a helper of this file that returns a wrapper: `model = wrap(model)`, `return DDP(net)`
            return any(isinstance(r, ast.Return) and r.value is not None and
                       (_has_ddp(r.value) or isinstance(r.value, ast.Name) and self.wrapped(r.value, r, depth + 1))
                       for r in self.walk_scope(func))
        return isinstance(value, ast.Name) and value.id != k and self.wrapped(value, value, depth + 1)


def _has_ddp(node) -> bool:
    return any(is_ddp_call(n) for n in ast.walk(node))
