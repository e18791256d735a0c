"""Rules about the training loop: sampler epochs, metrics, collectives (accumulation: rules_accum.py,
AMP: rules_amp.py)."""
from __future__ import annotations

import ast
import re

from . import rules_amp, structure  # noqa: F401  (rules_amp registers DDP012)
from .astutil import dotted, last
from .core import Hit, rule
from .pyfacts import COLLECTIVES, Module

EPOCHISH = re.compile(r"epoch", re.I)
# A metric's name, matched word by word (`val_acc`, `lossf`, `top1`; not `grad_accum_steps`).
METRIC_WORD = re.compile(r"^(loss\w*|acc\d*|accs|accuracy|accuracies|correct\w*|metrics?|ppl|perplexity|top\d+"
                         r"|err|error|f1|miou|bleu|auc)$", re.I)
REDUCING = re.compile(r"reduce|gather|all_?mean|sync|global|across", re.I)
PRINT0 = re.compile(r"^(print0|print_rank_?0|rank0_print|log0|master_print|print_master|main_print|rank_zero_info)$")
FEEDS = {"update", "append", "add", "extend", "add_", "update_state"}


def _metric(name: str) -> bool:
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).split("_")
    return any(METRIC_WORD.match(w) for w in words if w)


def _shuffles(call: ast.Call) -> bool:
    arg = next((kw.value for kw in call.keywords if kw.arg == "shuffle"), call.args[3] if len(call.args) > 3 else None)
    return arg is None or (isinstance(arg, ast.Constant) and arg.value is True)


@rule("DDP007", "DistributedSampler shuffles, but set_epoch is never called: every epoch repeats the "
      "order (and each rank the subset) of epoch 0.",
      fix="call sampler.set_epoch(epoch) at the start of every epoch, with the same epoch on every rank",
      section="set_epoch")
def no_set_epoch(m: Module):
    if any(isinstance(n, ast.Attribute) and n.attr == "set_epoch" for n in m.nodes):
        return
    if not any(m.is_sampler(c) and _shuffles(c) for c in m.calls):
        return
    for loop in m.nodes:
        head = ast.unparse(loop.target) + " " + ast.unparse(loop.iter) if isinstance(loop, ast.For) else \
            ast.unparse(loop.test) if isinstance(loop, ast.While) else None
        if head and EPOCHISH.search(head) and m.flow.reaches(loop, _is_for) and not m.flow.reaches(loop, _is_set_epoch):
            yield Hit(loop, "This epoch loop never calls sampler.set_epoch(epoch): DistributedSampler "
                            "shuffles with seed + epoch, so every epoch repeats the order of epoch 0.")


def _is_print(call: ast.Call) -> bool:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id == "print" or bool(PRINT0.match(f.id))
    return isinstance(f, ast.Attribute) and (bool(PRINT0.match(f.attr)) or (
        f.attr in ("info", "warning", "debug") and re.search(r"log", dotted(f.value) or "", re.I) is not None))


def _reduced(m: Module, scope) -> set:
    """Names in scope that hold cross-rank values: reduced or gathered, or computed from those."""
    names, assigns = set(), []
    for n in m.walk_scope(scope):
        if isinstance(n, ast.Call) and last(n) in COLLECTIVES - {"broadcast", "broadcast_object_list", "barrier",
                                                                 "scatter", "scatter_object_list"}:
            names |= {x.id for a in n.args for x in ast.walk(a) if isinstance(x, ast.Name)}
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                and (last(n) in COLLECTIVES or REDUCING.search(last(n))):
            names.add(n.func.value.id)  # loss_meter.all_reduce(), metric_logger.synchronize_between_processes()
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                and n.func.attr in FEEDS:
            assigns.append(({n.func.value.id}, n))   # losses_m.update(reduced_loss.item()): the meter holds it
        elif isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and n.value is not None:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            assigns.append(({x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name)}, n.value))
    for targets, value in assigns:
        if any(isinstance(c, ast.Call) and _reduces(m, c) for c in ast.walk(value)):
            names |= targets
    changed = True
    while changed:
        changed = False
        for targets, value in assigns:
            if not targets <= names and any(isinstance(x, ast.Name) and x.id in names for x in ast.walk(value)):
                names |= targets
                changed = True
    return names


def _reduces(m: Module, call: ast.Call) -> bool:
    """A call whose result is (or may be) the same on every rank: a reduction by name, a metric's
    compute(), an evaluation we cannot see into, or a function of this file with a collective."""
    name = last(call) or ""
    if REDUCING.search(name) or name == "compute" or re.search(r"eval|valid|test", name, re.I):
        return True
    func = m.flow.target(call)
    return func is not None and m.flow.reaches(func, _is_collective_call) is not None


def _is_for(node) -> bool:
    return isinstance(node, ast.For)


def _is_set_epoch(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "set_epoch"


def _is_collective_call(node) -> bool:
    return isinstance(node, ast.Call) and last(node) in COLLECTIVES


@rule("DDP008", "Rank 0 prints a metric computed on its own shard only: the number describes 1/N of "
      "the data, not the job.",
      fix="all-reduce [sum, count] first (dist.all_reduce), then print sum / count on rank 0",
      section="global_loss")
def per_rank_metric_printed(m: Module):
    for call in m.calls:
        if not _is_print(call) or not (PRINT0.match(last(call) or "") or m.rank0_only(call)):
            continue
        args = [*call.args, *(k.value for k in call.keywords)]
        if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "rank" in n.value.lower()
               or m.identity(n) for a in args for n in ast.walk(a)):
            continue  # it says whose number it is
        scope, reduced = m.scope(call), None
        for name in sorted({n.id for a in args for n in ast.walk(a) if isinstance(n, ast.Name) and _metric(n.id)}):
            reduced = _reduced(m, scope) if reduced is None else reduced
            if _shard_only(m, scope, name, reduced):
                yield Hit(call, f"Rank 0 prints {name}, computed on its own shard only: the number "
                                "describes 1/N of the data, not the job.")
                break


def _shard_only(m: Module, scope, name: str, reduced: set, depth: int = 0) -> bool:
    """name holds this rank's own metric: bound here, never reduced, and not computed on rank 0 on
    purpose (unless that computation only rescales another shard-only metric, `lossf = loss.item() * k`)."""
    bindings = m.assignments(scope, name)
    if not bindings or name in reduced or depth > 3:
        return False  # a parameter or a global (origin unknown), or a cross-rank value
    computed = [node for _, v, node in bindings if not isinstance(v, ast.Constant)]
    if computed and all(_over_whole_set(m, scope, node) for node in computed):
        return False  # every rank computed it over the whole (unsharded) data set
    on_rank0 = [(v, node) for _, v, node in bindings if m.rank0_only(node)]
    if not on_rank0:
        return True
    return all(v is not None for v, _ in on_rank0) and any(
        _shard_only(m, scope, n.id, reduced, depth + 1) for v, _ in on_rank0 for n in ast.walk(v)
        if isinstance(n, ast.Name) and n.id != name and _metric(n.id))


def _over_whole_set(m: Module, scope, node) -> bool:
    """node runs in a loop over a DataLoader built in scope without a sampler (every rank reads
    every sample); False when that cannot be told."""
    for loop in m.ancestors(node):
        if loop is scope:
            return False
        if isinstance(loop, (ast.For, ast.AsyncFor)):
            source = loop.iter.args[0] if isinstance(loop.iter, ast.Call) and last(loop.iter) == "enumerate" \
                and loop.iter.args else loop.iter
            values = [v for _, v, _ in m.assignments(scope, source.id)] if isinstance(source, ast.Name) else [source]
            if len(values) == 1 and isinstance(values[0], ast.Call) and last(values[0]) == "DataLoader":
                loader = values[0]
                return not any(kw.arg in ("sampler", "batch_sampler") for kw in loader.keywords) \
                    and len(loader.args) < 4 and not any(m.mentions_rank(a) for a in loader.args)
    return False


@rule("DDP009", "A collective inside a rank-0-only block: the other ranks never join it, so the job hangs "
      "until the timeout.",
      fix="call the collective on every rank (outside the if), and keep only the printing or saving "
          "inside it",
      section="skipped")
def collective_on_rank0(m: Module):
    imported: dict = {}

    def is_collective(c) -> bool:   # by the imports of the file that holds c (a helper's own file)
        if not isinstance(c, ast.Call):
            return False
        owner = m.owner(c)
        if owner not in imported:
            imported[owner] = _from_torch_distributed(owner)
        return _is_world_collective(c, imported[owner], owner.imported)
    unconditional = lambda c: is_collective(c) and not _up_to_caller(m, c)  # noqa: E731  (one object: cached)
    for call in m.calls:
        if is_collective(call):
            inner = None
        elif m.flow.target(call) is not None and m.rank0_only(call):   # evaluate(), which all-reduces inside
            inner = m.flow.reaches(m.flow.target(call), unconditional)
            if inner is None:
                continue
            inner = inner[0]
        else:
            continue
        guard = m.rank0_only(call)
        if not guard:
            continue
        scope = m.scope(call)
        same = (lambda c: last(c) == last(call)) if inner is None else (lambda c: m.flow.target(c) is m.flow.target(call))
        if any(isinstance(c, ast.Call) and c is not call and same(c) and not m.rank0_only(c)
               for c in m.walk_scope(scope)):
            continue  # the others call it elsewhere (`if rank != 0: barrier()` ... `if rank == 0: barrier()`)
        where = _condition(m, call, guard[0])
        yield Hit(call, (
            f"{ast.unparse(call.func)}() is a collective, but it runs only {where}: the other ranks never join it, "
            "so the job hangs until the timeout.") if inner is None else (
            f"{ast.unparse(call.func)}() calls {ast.unparse(inner.func)}() ({m.where(inner)}), a collective, but it "
            f"runs only {where}: the other ranks never join it, so the job hangs until the timeout."))


def _condition(m: Module, call, branch) -> str:
    """Where call sits, in words: `under `if rank == 0:``, `in the else of `if not is_main:``, or
    `after `if rank != 0: return``."""
    test = ast.unparse(branch.test)
    if isinstance(branch, ast.If) and not any(a is branch for a in m.ancestors(call)):
        leave = ast.unparse(branch.body[-1]).split("(")[0]
        return f"after `if {test}: {leave}` (line {branch.lineno})"
    if isinstance(branch, ast.IfExp):
        return f"where `{test}` holds (line {branch.lineno})"
    side = "under" if m.flow._side(call, branch) == "body" else "in the else of"
    return f"{side} `if {test}:` (line {branch.lineno})"


def _up_to_caller(m: Module, node) -> bool:
    """node sits under an `if` on a parameter of its function (`if together: dist.barrier()`): whether
    it runs depends on what the caller passes."""
    func = m.function(node)
    if func is None:
        return False
    params = {a.arg for a in [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]}
    return any(isinstance(n, ast.Name) and n.id in params
               for branch, _ in m.branches(node) for n in ast.walk(branch.test))


def _is_world_collective(call, imported: set, table: dict | None = None) -> bool:
    """A collective (structure.collective: dist.all_reduce(t), dcp.save(...), strategy.barrier()) on the
    default (whole-world) group. imported: names imported from torch.distributed; table: the file's imports."""
    if not structure.collective(call, table or {}, imported):
        return False
    return not (any(kw.arg in ("group", "process_group") for kw in call.keywords) or any(
        isinstance(n, (ast.Name, ast.Attribute)) and re.search(r"group|(^|_)pg$", ast.unparse(n), re.I)
        for a in call.args for n in ast.walk(a)))  # a subgroup: its members may be exactly the ranks here


def _from_torch_distributed(m: Module) -> set:
    return {a.asname or a.name for n in m.nodes if isinstance(n, ast.ImportFrom)
            and (n.module or "").startswith("torch.distributed") for a in n.names}
