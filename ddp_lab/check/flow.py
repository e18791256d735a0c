"""Following code across the functions, methods and branches of one file.

Real training code spreads one idea over several places: the epoch loop in `train()`, the batch
loop in `self._run_epoch()`; a `torch.save` in a helper; `if not torch.cuda.is_available():
sys.exit(...)` three lines above the line that needs a GPU. This module answers, for the rules:
- which function of this file a call runs (`f(...)`, `self.f(...)`, `obj.f(...)` with
  `obj = ThisClass(...)`), and what a node reaches through such calls, a few calls deep; when
  several files are checked together, also calls into the others (imports.py);
- whether two nodes sit in exclusive branches of one `if`/`elif`/`else`;
- which statements run before a node, and whether one of them makes sure of something (an
  `assert`, or an `if` that leaves the function or the program).
Answers lean to "don't know": a call it cannot resolve is not followed.
"""
from __future__ import annotations

import ast

from .astutil import key, last

DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
EXIT_CALLS = {"exit", "quit", "_exit", "abort"}   # sys.exit, exit(), os._exit, os.abort
DEPTH = 3


def below(node):
    """node and the nodes under it, not those of functions or classes defined inside it (a
    function's own body is walked when node is that function)."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        if n is node or not isinstance(n, DEFS):
            todo.extend(reversed(list(ast.iter_child_nodes(n))))


def exits(stmts) -> bool:
    """The block ends by leaving: return, raise, continue, break, sys.exit(...)."""
    if not stmts:
        return False
    s = stmts[-1]
    if isinstance(s, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
        return True
    return isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and last(s.value) in EXIT_CALLS


class Flow:
    def __init__(self, m):
        self.m = m
        self.functions: dict = {}   # name -> [module-level or nested function defs]
        self.methods: dict = {}     # (class, name) -> method def
        self.classes: dict = {}     # name -> class def
        for n in m.nodes:
            parent = m.parent.get(n)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if isinstance(parent, ast.ClassDef):
                    self.methods[(parent, n.name)] = n
                else:
                    self.functions.setdefault(n.name, []).append(n)
            elif isinstance(n, ast.ClassDef):
                self.classes[n.name] = n
        self.method_names = {name for _, name in self.methods}
        self._reach: dict = {}
        self._target: dict = {}
        self._reaches: dict = {}
        self._below_cache: dict = {}

    def enclosing_class(self, node):
        return next((a for a in self.m.ancestors(node) if isinstance(a, ast.ClassDef)), None)

    def target(self, call):
        """The function or method of this file (or of a file checked with it) that a call runs, or None."""
        if not isinstance(call, ast.Call):
            return None
        if id(call) not in self._target:
            found = self._resolve(call)
            if found is None and self.m.project is not None:
                found = self.m.project.callee(self.m, call)
            self._target[id(call)] = found
        return self._target[id(call)]

    def flow_of(self, node) -> "Flow":
        """The Flow of the file that holds node (this one, unless files are checked together)."""
        return self if self.m.project is None else self.m.owner(node).flow

    def _resolve(self, call):
        f = call.func
        if isinstance(f, ast.Name):
            defs = self.functions.get(f.id, [])
            return defs[0] if len(defs) == 1 else None
        if not isinstance(f, ast.Attribute):
            return None
        owner = key(f.value)
        if owner == "self":
            cls = self.enclosing_class(call)
            return self.methods.get((cls, f.attr)) if cls is not None else None
        if isinstance(f.value, ast.Name) and f.attr in self.method_names:   # trainer.train(), trainer = Trainer()
            scope = self.m.scope(call)
            for _, value, _ in reversed(self.m.assignments(scope, f.value.id)):
                if isinstance(value, ast.Call) and last(value) in self.classes:
                    return self.methods.get((self.classes[last(value)], f.attr))
        return None

    def reach(self, root, depth: int = DEPTH) -> list:
        """[(node, via)] for the nodes root runs: its own (via None) and, through calls of this
        file's functions (and those of files checked with it) up to `depth` calls deep, theirs
        (via: the call in root that leads there)."""
        owner = self.flow_of(root)
        if owner is not self:   # another file's function: its own Flow keeps the answer for every caller
            return owner.reach(root, depth)
        k = (id(root), depth)
        if k not in self._reach:
            out, seen = [], {id(root), *(id(a) for a in self.m.ancestors(root))}   # no recursion

            def walk(flow, node, via, d):
                for n in flow._below(node):
                    out.append((n, via))
                    if d < depth and isinstance(n, ast.Call):
                        func = flow.target(n)
                        if func is not None and id(func) not in seen:
                            seen.add(id(func))
                            walk(flow.flow_of(func), func, via or n, d + 1)
            walk(self, root, None, 0)
            self._reach[k] = out
        return self._reach[k]

    def _below(self, node) -> list:
        if id(node) not in self._below_cache:
            self._below_cache[id(node)] = list(below(node))
        return self._below_cache[id(node)]

    def reaches(self, root, test, depth: int = DEPTH):
        """The first (node, via) reached from root for which test(node) holds, or None (answers for
        a named test function are kept: rules ask the same question of one function many times)."""
        owner = self.flow_of(root)
        if owner is not self:
            return owner.reaches(root, test, depth)
        k = (id(root), test, depth)
        if k not in self._reaches:
            self._reaches[k] = next(((n, via) for n, via in self.reach(root, depth) if n is not root and test(n)), None)
        return self._reaches[k]

    # ------------------------------------------------------------ branches
    def _side(self, node, branch) -> str | None:
        child = node
        for a in self.m.ancestors(node):
            if a is branch:
                if child is getattr(a, "test", None):
                    return "test"
                body = a.body if isinstance(a.body, list) else [a.body]
                return "body" if any(child is s for s in body) else "orelse"
            child = a
        return None

    def exclusive(self, a, b) -> bool:
        """a and b sit in different branches of one if/elif/else (or `x if c else y`): at most one runs."""
        around_a = {id(x) for x in self.m.ancestors(a)}
        for branch in self.m.ancestors(b):
            if isinstance(branch, (ast.If, ast.IfExp)) and id(branch) in around_a:
                if {self._side(a, branch), self._side(b, branch)} == {"body", "orelse"}:
                    return True
        return False

    def before(self, node):
        """The statements that run before node in the blocks around it, nearest first, up to its
        function (an `if` before node is yielded whole, not its branches)."""
        m = self.m
        holder = m.statement(node)
        while True:
            block = m.parent.get(holder)
            if block is None:
                return
            for field in ("body", "orelse", "finalbody"):
                stmts = getattr(block, field, None)
                if isinstance(stmts, list) and any(s is holder for s in stmts):
                    i = next(i for i, s in enumerate(stmts) if s is holder)
                    yield from reversed(stmts[:i])
            if isinstance(block, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module, ast.Lambda)):
                return
            holder = block

    def ensured(self, node, test, depth: int = 2) -> bool:
        """Does the code make sure of `test` (a predicate on an expression) before node runs? An
        `assert` of it, an `if` on it that leaves (return, raise, sys.exit) in some branch, an `if`
        on it around node; or every call of node's function in this file is so guarded."""
        for branch in self.m.ancestors(node):
            if isinstance(branch, (ast.If, ast.IfExp)) and self._side(node, branch) == "body" and test(branch.test):
                return True
            if isinstance(branch, DEFS):
                break
        for stmt in self.before(node):
            if isinstance(stmt, ast.Assert) and test(stmt.test):
                return True
            if isinstance(stmt, ast.If) and test(stmt.test) and (exits(stmt.body) or exits(stmt.orelse)):
                return True
        func = self.m.function(node)
        if func is None or depth <= 0:
            return False
        calls = [c for c in self.m.calls if self.target(c) is func]
        return bool(calls) and all(self.ensured(c, test, depth - 1) for c in calls)
