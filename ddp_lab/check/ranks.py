"""Who is who: rank names, rank-0 tests, and the checks that keep code off some ranks.

"local" is LOCAL_RANK (0 once per node), "global" the rank in the whole job. A *flag* is a
name that holds a rank-0 test (`is_main`, `master_process = rank == 0`).
"""
from __future__ import annotations

import ast
import re

from .astutil import dotted, key, last, pairs

MAIN_FLAG = re.compile(r"is_main|is_master|main_process|master_process|is_chief|rank_?zero|is_rank_?0"
                       r"|is_world_process_zero|is_global_zero|should_save|is_leader", re.I)
LOCAL_FLAG = re.compile(r"local_main|local_master|is_local_process_zero|is_local_rank_?0", re.I)
# The parts a global rank is computed from: node index times processes (GPUs) per node, plus the
# local index (`args.rank * ngpus_per_node + gpu`, ImageNet's main_worker).
PER_NODE = re.compile(r"per_?node|device_count|local_world_size|local_size|nproc|^n_?gpus$|^num_gpus$|^gpus$", re.I)
NODE = re.compile(r"node_?(rank|id|idx|index)$|^node$|^nodeid$|^nr$|machine_?rank", re.I)
GLOBAL_ENV = {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"}
LOCAL_ENV = {"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK"}
# Tests on these may also keep a save on one process (world of one, "if distributed").
SINGLE = re.compile(r"world_size|distributed|\bddp\b|is_dist|num_replicas", re.I)


def name_kind(ident: str) -> tuple[str, bool] | None:
    """("local" | "global", is_flag) for an identifier that names a rank or a rank-0 flag."""
    n = ident.lower()
    if "local_rank" in n or n in ("localrank", "lrank"):
        return "local", False
    if n == "rank" or (n.endswith("_rank") and not n.startswith(("node", "group", "local"))):
        return "global", False
    if LOCAL_FLAG.search(n):
        return "local", True
    if MAIN_FLAG.search(n):
        return "global", True
    return None


class RankFacts:
    """Mixed into pyfacts.Module, which provides tree, parent, ancestors(), branches(), statement()
    and function()."""

    def _aliases(self) -> dict:
        """Names bound to a rank (`gpu_id = int(os.environ["LOCAL_RANK"])`, `r = dist.get_rank()`, the
        name handed to `init_process_group(rank=...)`) or a rank-0 test (`master = r == 0`), across the
        module, followed through each other; a name bound to both kinds is dropped."""
        self.aliases = {}
        for _ in range(3):   # `r = dist.get_rank()` makes `lead = r == 0` a flag on the next pass
            found: dict = {}
            for node in self.nodes:
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        for k, v in pairs(t, node.value):
                            kind = self.identity(v) if v is not None else None
                            test = self.rank0_test(v) if v is not None and kind is None else None
                            if k and (kind or test):
                                found.setdefault(k, set()).add((kind, False) if kind else (test[0], True))
                elif isinstance(node, ast.Call) and last(node) == "init_process_group":
                    given = next((kw.value for kw in node.keywords if kw.arg == "rank"),
                                 node.args[4] if len(node.args) > 4 else None)
                    if key(given) and not name_kind(key(given).split(".")[-1]):
                        found.setdefault(key(given), set()).add(("global", False))
            aliases = {k: next(iter(v)) for k, v in found.items() if len(v) == 1}
            if aliases == self.aliases:
                break
            self.aliases = aliases
        return self.aliases

    def identity(self, node) -> str | None:
        """"local"/"global" when node itself is a process id: a rank name, get_rank(), RANK/LOCAL_RANK."""
        if isinstance(node, (ast.Name, ast.Attribute)):
            ident = node.id if isinstance(node, ast.Name) else node.attr
            nk = name_kind(ident) or self.aliases.get(key(node) or "")
            return nk[0] if nk and not nk[1] else None
        if isinstance(node, ast.Call):
            name = last(node)
            if name in ("get_rank", "get_global_rank", "get_node_local_rank") or dotted(node.func) == "hvd.rank":
                return "local" if name == "get_node_local_rank" else "global"
            if name in ("get_local_rank", "local_rank"):
                return "local"
            if name in ("int", "str") and len(node.args) == 1:
                return self.identity(node.args[0])
            if name in ("get", "getenv") and node.args:
                return _env_kind(node.args[0])
        if isinstance(node, ast.IfExp):   # `dist.get_rank() if dist.is_initialized() else 0`
            kinds = [self.identity(side) for side in (node.body, node.orelse) if not _is_zero(side)]
            return kinds[0] if len(kinds) == 1 or (kinds and kinds[0] == kinds[-1]) else None
        if isinstance(node, ast.Subscript) and dotted(node.value) == "os.environ":
            return _env_kind(node.slice)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and _node_offset(node):
            return "global"
        return None

    def mentions_rank(self, expr) -> bool:
        return any(self.identity(n) or self.flag(n) for n in ast.walk(expr))

    def flag(self, node) -> str | None:
        """"local"/"global" when node is a rank-0 flag: `is_main`, `accelerator.is_main_process`."""
        target = node.func if isinstance(node, ast.Call) else node
        if isinstance(target, (ast.Name, ast.Attribute)):
            ident = target.id if isinstance(target, ast.Name) else target.attr
            nk = name_kind(ident) or self.aliases.get(key(target) or "")
            return nk[0] if nk and nk[1] else None
        return None

    def rank0_test(self, test) -> tuple[str, bool] | None:
        """(kind, True) if the test holds on rank 0 only, (kind, False) if on every rank but 0."""
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            return next((r for r in map(self.rank0_test, test.values) if r and r[1]), None)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = self.rank0_test(test.operand)
            if inner:
                return inner[0], not inner[1]
            kind = self.identity(test.operand)
            return (kind, True) if kind else None
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            a, op, b = test.left, test.ops[0], test.comparators[0]
            if _is_zero(b) or _is_zero(a):
                kind = self.identity(a if _is_zero(b) else b)
                if kind and isinstance(op, (ast.Eq, ast.NotEq, ast.Gt)):
                    return kind, isinstance(op, ast.Eq)
            if isinstance(op, (ast.In, ast.NotIn)) and isinstance(b, (ast.Tuple, ast.List, ast.Set)) \
                    and any(_is_zero(e) for e in b.elts):
                kind = self.identity(a)
                return (kind, isinstance(op, ast.In)) if kind else None
            return None
        kind = self.flag(test)
        return (kind, True) if kind else None

    def rank0_only(self, node) -> tuple[ast.AST, str] | None:
        """(the if, kind) when node runs on rank 0 only (or on one process per node, kind local):
        inside `if rank == 0:`, or after `if not is_master(args): return` in its function."""
        for branch, in_body in self.branches(node):
            r = self.rank0_test(branch.test)
            if r and r[1] == in_body:
                return branch, r[0]
        for stmt in self.flow.before(node):
            r = self.rank0_test(stmt.test) if isinstance(stmt, ast.If) else None
            if r and not r[1] and stmt.body and isinstance(stmt.body[-1], (ast.Return, ast.Raise)):
                return stmt, r[0]
        return None

    def guarded(self, node) -> bool:
        """Does a rank check (or an early exit on a rank check) keep node off some ranks?"""
        for branch, _ in self.branches(node):
            if self.mentions_rank(branch.test) or _mentions(branch.test, SINGLE):
                return True
        func = self.function(node)
        if func is not None and (MAIN_FLAG.search(func.name) or re.search(r"master|rank_?0", func.name)
                                 or any(MAIN_FLAG.search(ast.unparse(d)) for d in func.decorator_list)):
            return True
        stmt, anc = self.statement(node), list(self.ancestors(node))
        for holder in [stmt, *anc]:
            if holder is func:
                break
            block = self.parent.get(holder)
            for field in ("body", "orelse", "finalbody"):
                stmts = getattr(block, field, None)
                if isinstance(stmts, list) and any(s is holder for s in stmts):
                    for s in stmts[:[i for i, x in enumerate(stmts) if x is holder][0]]:
                        if isinstance(s, ast.If) and self.mentions_rank(s.test) and s.body and \
                                isinstance(s.body[-1], (ast.Return, ast.Continue, ast.Raise, ast.Break)):
                            return True
        return False


def _env_kind(node) -> str | None:
    if isinstance(node, ast.Constant):
        return "global" if node.value in GLOBAL_ENV else "local" if node.value in LOCAL_ENV else None
    return None


def _words(node) -> list[str]:
    """The names and environment variables an expression reads."""
    return [n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else
            n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else
            last(n) or "" if isinstance(n, ast.Call) else "" for n in ast.walk(node)]


def _node_offset(node: ast.BinOp) -> bool:
    """`a * b + c` where the product is a node's first rank: a node index, or anything times the
    processes per node (`args.rank * ngpus_per_node + gpu`, `node_rank * torch.cuda.device_count() + i`)."""
    for side in (node.left, node.right):
        if isinstance(side, ast.BinOp) and isinstance(side.op, ast.Mult):
            words = [w for f in (side.left, side.right) for w in _words(f) if w]
            node_first = any(NODE.search(w) for w in words) or (
                any("rank" in w.lower() for w in words) and any(PER_NODE.search(w) for w in words))
            if node_first:
                return True
    return False


def _is_zero(node) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def _mentions(expr, pattern) -> bool:
    return any(isinstance(n, (ast.Name, ast.Attribute)) and pattern.search(n.id if isinstance(n, ast.Name) else n.attr)
               for n in ast.walk(expr))
