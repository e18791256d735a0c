"""Rules about per-rank decisions, devices, ports and the wrong wrapper."""
from __future__ import annotations

import ast
import re

from .astutil import dotted, key, last
from .core import Hit, rule
from .pyfacts import COLLECTIVES, Module

NONFINITE = {"isfinite", "isnan", "isinf", "isneginf", "isposinf"}
SKIPS = (ast.Continue, ast.Break, ast.Return)
# What a rank computes from its own batch (a learning rate or a step count is the same everywhere).
PER_BATCH = re.compile(r"loss|logit|out|pred|score", re.I)
SPAWNERS = {"spawn", "start_processes", "Process"}
FIXED_TCP = re.compile(r"^tcp://[^:/]*:\d+$")


def _loop_or_function(m: Module, node) -> list:
    """The nodes of the loop or function that holds node (not of functions defined inside it)."""
    owner = next(a for a in m.ancestors(node) if isinstance(a, (ast.For, ast.AsyncFor, ast.While, ast.FunctionDef,
                                                                 ast.AsyncFunctionDef, ast.Module)))
    return [] if isinstance(owner, ast.Module) else list(m.walk_scope(owner))


def _reduced_names(m: Module, scope) -> set:
    """Names handed to a collective in scope: their values are the same on every rank afterwards."""
    return {n.id for c in m.walk_scope(scope) if isinstance(c, ast.Call) and last(c) in COLLECTIVES
            for a in c.args for n in ast.walk(a) if isinstance(n, ast.Name)}


def _per_rank_nonfinite(m: Module, test, at) -> bool:
    """test asks isfinite/isnan of a per-batch value (a loss, the outputs) that went through no
    collective (directly, or through one name bound to such a check)."""
    reduced = _reduced_names(m, m.scope(at))
    for n in ast.walk(test):
        if isinstance(n, ast.Call) and last(n) in NONFINITE:
            owner = n.func.value if isinstance(n.func, ast.Attribute) else None
            checked = list(n.args) if owner is None or dotted(owner) in ("torch", "math", "np", "numpy") \
                else [owner, *n.args]
            names = {x.id for a in checked for x in ast.walk(a) if isinstance(x, ast.Name)}
            if any(PER_BATCH.search(x) for x in names) and not names & reduced:
                return True
        if isinstance(n, ast.Name) and n.id not in reduced:
            bound = [v for line, v, _ in m.assignments(m.scope(at), n.id) if line < at.lineno and v is not None]
            if bound and any(isinstance(c, ast.Call) and last(c) in NONFINITE for c in ast.walk(bound[-1])):
                names = {x.id for x in ast.walk(bound[-1]) if isinstance(x, ast.Name)}
                if any(PER_BATCH.search(x) for x in names) and not names & reduced:
                    return True
    return False


def _backward_after(m: Module, branch: ast.If) -> bool:
    return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "backward"
               and c.lineno > branch.end_lineno for c in _loop_or_function(m, branch))


@rule("DDP017", "A rank skips its step on a non-finite loss before backward: the other ranks go on into "
      "backward's all-reduce, so the ranks' steps no longer match and the job hangs or mixes steps.",
      fix="decide together: all-reduce a 0/1 flag (dist.all_reduce(bad, op=dist.ReduceOp.MAX)) and skip on "
          "every rank when it is set, or let torch.amp.GradScaler skip the step (it agrees across ranks)",
      section="skipped")
def nonfinite_skip(m: Module):
    if not (m.is_ddp and m.multiprocess):
        return
    for node in m.nodes:
        if isinstance(node, ast.If) and node.body and isinstance(node.body[-1], SKIPS) \
                and _per_rank_nonfinite(m, node.test, node) and _backward_after(m, node):
            yield Hit(node.test)


# ------------------------------------------------------------ DDP018: global rank as device index
def _global_source(m: Module, expr, at, depth: int = 0) -> bool:
    """expr is the global rank read from where it is set: get_rank(), RANK, or a name bound to one."""
    if depth > 3 or expr is None:
        return False
    if isinstance(expr, ast.Call) and last(expr) in ("int", "str") and len(expr.args) == 1:
        return _global_source(m, expr.args[0], at, depth)
    if isinstance(expr, (ast.Call, ast.Subscript, ast.BinOp)):
        return m.identity(expr) == "global"
    k = key(expr)
    if k is None:
        return _attribute_source(m, expr, at, depth)
    if k.startswith("self."):
        cls = next((a for a in m.ancestors(at) if isinstance(a, ast.ClassDef)), None)
        values = [n.value for n in ast.walk(cls) if isinstance(n, ast.Assign)
                  and any(key(t) == k for t in n.targets)] if cls else []
        return len(values) == 1 and _global_source(m, values[0], values[0], depth + 1)
    here = m.scope(at)
    if isinstance(here, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and \
            k in {a.arg for a in ast.walk(here.args) if isinstance(a, ast.arg)}:
        return False   # a parameter: whoever calls decides (mp.spawn passes the local index)
    for scope in dict.fromkeys((here, m.tree)):
        bound = [(line, v) for line, v, _ in m.assignments(scope, k) if scope is not here or line < at.lineno]
        if bound:
            return bound[-1][1] is not None and _global_source(m, bound[-1][1], bound[-1][1], depth + 1)
    return False


def _attribute_source(m: Module, expr, at, depth: int) -> bool:
    """`args.rank` set to the global rank earlier in this function (`args.rank = args.rank * ngpus_per_node
    + gpu`); whatever it held before that (a node index, from the command line) is not known."""
    name = dotted(expr)
    if name is None or not isinstance(expr, ast.Attribute):
        return False
    bound = [n for n in m.walk_scope(m.scope(at)) if isinstance(n, ast.Assign) and n.lineno < at.lineno
             and any(dotted(t) == name for t in n.targets)]
    return bool(bound) and _global_source(m, max(bound, key=lambda n: n.lineno).value, at, depth + 1)


def _device_indices(call: ast.Call):
    """(expr used as a CUDA device index, node to report) in this call."""
    name, func = last(call), dotted(call.func) or ""
    if func in ("torch.cuda.set_device", "torch.cuda.device") and call.args:
        yield call.args[0], call.args[0]
    elif name == "cuda" and isinstance(call.func, ast.Attribute) and call.args:   # x.cuda(rank)
        yield call.args[0], call.args[0]
    elif func == "torch.device" and len(call.args) == 2 and isinstance(call.args[0], ast.Constant) \
            and call.args[0].value == "cuda":
        yield call.args[1], call.args[1]
    for a in [*call.args, *(kw.value for kw in call.keywords)]:
        if isinstance(a, ast.JoinedStr) and isinstance(a.values[0], ast.Constant) and a.values[0].value == "cuda:" \
                and len(a.values) == 2:
            yield a.values[1].value, a                                            # f"cuda:{rank}"
    for kw in call.keywords:
        if kw.arg == "device_ids" and isinstance(kw.value, (ast.List, ast.Tuple)) and len(kw.value.elts) == 1:
            yield kw.value.elts[0], kw.value.elts[0]
        elif kw.arg == "output_device":
            yield kw.value, kw.value


@rule("DDP018", "The global rank used as a CUDA device index: on the second node it is 8, 9, ... and there "
      "is no such GPU (or two processes share one).",
      fix="pick the device with LOCAL_RANK: local_rank = int(os.environ['LOCAL_RANK']); "
          "torch.cuda.set_device(local_rank); device_ids=[local_rank]",
      section="identity")
def global_rank_device(m: Module):
    for call in m.calls:
        for index, where in _device_indices(call):
            if _global_source(m, index, call):
                yield Hit(where)


# ------------------------------------------------------------ DDP019: a fixed port in a launcher
def _spawns(m: Module) -> bool:
    return any(last(c) in SPAWNERS and re.search(r"mp|multiprocessing|torch", dotted(c.func) or "")
               for c in m.calls if isinstance(c.func, ast.Attribute)) or any(
        isinstance(n, ast.ImportFrom) and (n.module or "").endswith("multiprocessing")
        and any(a.name in SPAWNERS for a in n.names) for n in m.nodes)


def _fixed_port(value) -> bool:
    if isinstance(value, ast.Constant):
        return isinstance(value.value, int) and not isinstance(value.value, bool) or \
            isinstance(value.value, str) and value.value.strip().isdigit()
    return isinstance(value, ast.Call) and last(value) == "str" and len(value.args) == 1 and _fixed_port(value.args[0])


@rule("DDP019", "A fixed MASTER_PORT in a program that starts its own processes: a second copy on the same "
      "machine (another run, a sweep, a test) fails with EADDRINUSE (address already in use).",
      fix="ask the OS for a free port (bind a socket to port 0, read its number) and pass it to the workers, "
          "or launch with torchrun --standalone, which picks one",
      section="launch")
def fixed_port(m: Module):
    if not _spawns(m):
        return
    for node in m.nodes:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript) \
                and dotted(node.targets[0].value) == "os.environ" and isinstance(node.targets[0].slice, ast.Constant) \
                and node.targets[0].slice.value == "MASTER_PORT" and _fixed_port(node.value):
            yield Hit(node.value)
        elif isinstance(node, ast.Call) and last(node) == "init_process_group":
            for kw in node.keywords:
                if kw.arg == "init_method" and isinstance(kw.value, ast.Constant) \
                        and isinstance(kw.value.value, str) and FIXED_TCP.match(kw.value.value):
                    yield Hit(kw.value, f"init_method={kw.value.value!r}: a fixed port in a program that starts "
                                        "its own processes; a second copy on this machine fails with EADDRINUSE.")


# ------------------------------------------------------------ DDP020: DataParallel under torchrun
@rule("DDP020", "nn.DataParallel in a program that runs once per GPU (torchrun, LOCAL_RANK, "
      "init_process_group): every process replicates the model over all its visible GPUs, and the "
      "processes never average their gradients.",
      fix="wrap with DistributedDataParallel(model, device_ids=[local_rank]) and drop DataParallel",
      section="dataparallel")
def dataparallel_in_ddp(m: Module):
    if not m.multiprocess:
        return
    distributed = "torchrun" in m.text or any(last(c) == "init_process_group" for c in m.calls) or any(
        isinstance(n, ast.Constant) and n.value == "LOCAL_RANK" for n in m.nodes)
    if not distributed:
        return
    for call in m.calls:
        if last(call) == "DataParallel" and not m.guarded(call) and not _in_branch_choosing(m, call):
            yield Hit(call)


def _in_branch_choosing(m: Module, call) -> bool:
    """`DDP(model) if ... else DataParallel(model)`, or an if/else with DDP in the other branch."""
    for branch, _ in m.branches(call):
        if any(isinstance(c, ast.Call) and last(c) in ("DDP", "DistributedDataParallel") for c in ast.walk(branch)):
            return True
    return False
