"""Following imports between the files checked together.

`ddp-lab check main.py utils.py` (or a folder) reads `import utils`, `import pkg.misc as misc`,
`from utils import f`, `from .engine import f` and `from pkg.misc import Cls as Alias`, finds the
file each one names among the files checked, and lets flow.py follow calls into it:
`utils.evaluate(...)`, `save_checkpoint(...)`, `loss_scaler(...)` where
`loss_scaler = NativeScalerWithGradNormCount()` (its `__call__`), also when `loss_scaler` came in as
a parameter from this file's caller. A module name is looked up relative to the importing file's
folder (and the folder above its package), and to the paths given and the folders above them;
never through sys.path, and nothing is imported. Each file is read and parsed once.
"""
from __future__ import annotations

import ast
import os

from .astutil import dotted, key, last
from .pyfacts import Module

FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
AMBIGUOUS = object()


def norm(path) -> str:
    return os.path.normpath(os.path.abspath(path))


class Project:
    def __init__(self, files, roots, read):
        """files: the Python files checked; roots: the paths given; read(path) -> (text, tree), or
        raises (files.Unreadable)."""
        self.paths = {norm(p): p for p in files}
        bases = []
        for r in roots:
            d = norm(r) if os.path.isdir(r) else os.path.dirname(norm(r))
            bases += [d, os.path.dirname(d)]
        self.bases = list(dict.fromkeys(bases))
        self.parent: dict = {}      # shared by every module: a node's parent, whichever file holds it
        self._read = read
        self._modules: dict = {}    # path -> Module, or the exception reading it raised
        self._by_tree: dict = {}
        self.memo: dict = {}        # answers rules keep about one function, asked from every file that calls it

    # ------------------------------------------------------------ files
    def module(self, path):
        """The Module of a checked file, parsed once; raises what reading it raised."""
        k = norm(path)
        if k not in self._modules:
            try:
                text, tree = self._read(self.paths.get(k, path))
                m = Module(tree, text, parent=self.parent, project=self, path=k)
                self._by_tree[id(tree)] = m
                self._modules[k] = m
            except Exception as e:  # noqa: BLE001  (kept, raised again where the file is checked)
                self._modules[k] = e
        m = self._modules[k]
        if isinstance(m, Exception):
            raise m
        return m

    def _get(self, k):
        try:
            return self.module(k)
        except Exception:  # noqa: BLE001  (an unreadable file is reported where it is checked)
            return None

    def module_of(self, node):
        while node in self.parent:
            node = self.parent[node]
        return self._by_tree.get(id(node))

    def find(self, m, name: str, level: int = 0):
        """The checked file a module name means in m (`utils`, `pkg.misc`, `.engine`), or None."""
        here = os.path.dirname(m.path)
        if level:
            base = here
            for _ in range(level - 1):
                base = os.path.dirname(base)
            bases = [base]
        else:
            top = here
            while os.path.join(top, "__init__.py") in self.paths:
                top = os.path.dirname(top)
            bases = [here, top, *self.bases]
        parts = name.split(".") if name else []
        for b in dict.fromkeys(bases):
            stem = os.path.join(b, *parts)
            cands = (stem + ".py", os.path.join(stem, "__init__.py")) if parts else (os.path.join(b, "__init__.py"),)
            for cand in cands:
                if cand in self.paths and cand != m.path:
                    return self._get(cand)
        return None

    # ------------------------------------------------------------ names
    def names(self, m) -> dict:
        """name (or dotted name) -> Module, or (Module, attribute), for m's imports of checked files."""
        if m._imports is None:
            table: dict = {}

            def bind(k, v):
                table[k] = v if table.get(k, v) == v else AMBIGUOUS
            for n in m.nodes:
                if isinstance(n, ast.Import):
                    for a in n.names:
                        if a.asname:
                            found = self.find(m, a.name)
                            if found is not None:
                                bind(a.asname, found)
                            continue
                        parts = a.name.split(".")
                        for i in range(1, len(parts) + 1):
                            found = self.find(m, ".".join(parts[:i]))
                            if found is not None:
                                bind(".".join(parts[:i]), found)
                elif isinstance(n, ast.ImportFrom):
                    for a in n.names:
                        if a.name == "*":
                            continue
                        sub = self.find(m, f"{n.module}.{a.name}" if n.module else a.name, n.level)
                        base = None if sub is not None else self.find(m, n.module or "", n.level)
                        if sub is not None or base is not None:
                            bind(a.asname or a.name, sub if sub is not None else (base, a.name))
            m._imports = {k: v for k, v in table.items() if v is not AMBIGUOUS}
        return m._imports

    def lookup(self, mod, name: str, depth: int = 0):
        """What `name` is in mod: a top-level function or class def, or a Module; followed through
        mod's own imports (`from .misc import f` in a package's __init__.py)."""
        if mod._toplevel is None:
            found: dict = {}
            todo = list(mod.tree.body)
            while todo:
                s = todo.pop(0)
                if isinstance(s, (*FUNCS, ast.ClassDef)):
                    found.setdefault(s.name, []).append(s)
                elif isinstance(s, (ast.If, ast.Try)):
                    todo += [*s.body, *s.orelse, *getattr(s, "finalbody", []),
                             *(x for h in getattr(s, "handlers", []) for x in h.body)]
            mod._toplevel = {k: v[0] for k, v in found.items() if len(v) == 1}
        if name in mod._toplevel:
            return mod._toplevel[name]
        v = self.names(mod).get(name)
        if isinstance(v, tuple) and depth < 3:
            return self.lookup(v[0], v[1], depth + 1)
        return v

    def _expr(self, m, node):
        """The def, class or Module an expression names in m: `f`, `utils`, `utils.f`, `pkg.misc.Cls`."""
        if isinstance(node, ast.Name):
            if node.id in m.flow.classes:
                return m.flow.classes[node.id]
            if node.id in m.flow.functions:
                return None   # this file's own (resolved, or not, by flow.py)
            v = self.names(m).get(node.id)
            return self.lookup(*v) if isinstance(v, tuple) else v
        name = dotted(node)
        if isinstance(node, ast.Attribute) and name:
            v = self.names(m).get(name)
            if v is not None:
                return self.lookup(*v) if isinstance(v, tuple) else v
            owner = self._expr(m, node.value)
            if owner is not None and not isinstance(owner, ast.AST):
                return self.lookup(owner, node.attr)
        return None

    # ------------------------------------------------------------ calls
    def callee(self, m, call):
        """The function or method, in any checked file, that a call of m runs (flow.py asks when
        the call is not to one of m's own functions), or None."""
        if not m.flow.classes and not self.names(m):
            return None   # nothing imported from the files checked, no class of its own: nothing to find
        f = call.func
        if isinstance(f, ast.Name):
            if f.id in m.flow.functions:
                return None
            target = self._expr(m, f)
            if isinstance(target, FUNCS):
                return target
            if "__call__" not in self._methods(m):
                return None
            return self.method(self.instance(m, f, call), "__call__")      # loss_scaler(loss, optimizer)
        if not isinstance(f, ast.Attribute):
            return None
        target = self._expr(m, f)
        if isinstance(target, FUNCS):                                        # utils.evaluate(...)
            return target
        if f.attr not in self._methods(m):
            return None
        if key(f.value) == "self":                                           # a method of an imported base class
            cls = m.flow.enclosing_class(call)
            for base in cls.bases if cls is not None else []:
                found = self.method(self._expr(m, base), f.attr)
                if found is not None:
                    return found
            return None
        return self.method(self.instance(m, f.value, call), f.attr)          # scaler.step(), scaler = Cls()

    def _methods(self, m) -> set:
        """Names of the methods of every class m can name (its own, and those of the files it
        imports): a call of any other name is no method call to follow."""
        k = ("methods", id(m))
        if k not in self.memo:
            mods = {id(m): m}
            for v in self.names(m).values():
                mod = v[0] if isinstance(v, tuple) else v
                mods[id(mod)] = mod
            self.memo[k] = {name for mod in mods.values() for (_, name) in mod.flow.methods}
        return self.memo[k]

    def method(self, cls, name: str):
        if not isinstance(cls, ast.ClassDef):
            return None
        owner = self.module_of(cls)
        return owner.flow.methods.get((cls, name)) if owner is not None else None

    def instance(self, m, expr, at, depth: int = 0):
        """The class of which expr (a name) holds an instance where `at` runs: `x = Cls(...)` before it
        in its scope, or, for a parameter, what every caller in m passes (`f(..., Cls())`)."""
        if not isinstance(expr, ast.Name) or depth > 2:
            return None
        scope = m.scope(at)
        bound = [v for line, v, _ in m.assignments(scope, expr.id) if line <= at.lineno]
        if bound:
            v = bound[-1]
            cls = self._expr(m, v.func) if isinstance(v, ast.Call) else None
            return cls if isinstance(cls, ast.ClassDef) else None
        if not isinstance(scope, FUNCS) or isinstance(m.parent.get(scope), ast.ClassDef):
            return None
        params = [a.arg for a in [*scope.args.posonlyargs, *scope.args.args]]
        kwonly = [a.arg for a in scope.args.kwonlyargs]
        if expr.id not in params + kwonly:
            return None
        found = set()
        for c in m.callers(scope):
            if not isinstance(c, ast.Call) or last(c) != scope.name:
                continue
            i = params.index(expr.id) if expr.id in params else None
            arg = c.args[i] if i is not None and i < len(c.args) and not any(
                isinstance(a, ast.Starred) for a in c.args[:i + 1]) else \
                next((kw.value for kw in c.keywords if kw.arg == expr.id), None)
            cls = self.instance(m, arg, c, depth + 1) if arg is not None else None
            if cls is None:
                return None
            found.add(cls)
        return found.pop() if len(found) == 1 else None
