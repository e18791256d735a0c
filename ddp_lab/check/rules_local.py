"""Rules about values one rank holds alone: an EMA updated on rank 0 only, gradients clipped before
the all-reduce, an early stop decided on one rank."""
from __future__ import annotations

import ast
import re

from .astutil import dotted, key, last
from .core import Hit, rule
from .pyfacts import COLLECTIVES, Module
from .rules_accum import _is_backward, _is_optimizer_step, _window_test, optimizers
from .rules_train import _condition, _from_torch_distributed, _is_world_collective, _metric

# ------------------------------------------------------------ DDP021: an EMA only rank 0 updates
EMA_NAME = re.compile(r"(^|_)(ema|swa)(_|\d|$)|^ema|averaged|(^|_)avg_model|model_avg|shadow", re.I)
QUIET = {"to", "cuda", "cpu", "eval", "train", "half", "float", "bfloat16", "requires_grad_", "update",
         "update_parameters", "update_attr", "load_state_dict", "register_buffer"}
EVALUATES = re.compile(r"(^|_)(eval|valid|test|infer|predict)", re.I)


def _ema_updates(m: Module):
    """(EMA key, node to report) for each update of an averaged copy: `ema.update(model)`,
    `swa_model.update_parameters(model)`, `for e, p in zip(ema.parameters(), ...): e.mul_(d)...`."""
    for node in m.nodes:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            k = key(node.func.value) or dotted(node.func.value)
            if k and (node.func.attr == "update_parameters" or
                      node.func.attr == "update" and EMA_NAME.search(k.rsplit(".", 1)[-1])):
                yield k, node
        elif isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and last(node.iter) == "zip":
            inplace = any(isinstance(c, ast.Call) and last(c) in ("mul_", "lerp_", "add_", "copy_")
                          for s in node.body for c in ast.walk(s))
            for arg in node.iter.args:
                base = arg.func.value if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) else arg
                k = key(base) or dotted(base)
                if inplace and k and EMA_NAME.search(k.rsplit(".", 1)[-1]):
                    yield k, node
                    break


def _ema_uses(m: Module, k: str, update):
    """(node, what) where the averaged copy is evaluated or saved, in the scope (or class) of update."""
    cls = next((a for a in m.ancestors(update) if isinstance(a, ast.ClassDef)), None)
    nodes = list(ast.walk(cls)) if k.startswith("self.") and cls is not None else list(m.walk_scope(m.scope(update)))
    for n in nodes:
        if not isinstance(n, ast.Call) or n is update:
            continue
        func = n.func
        if (key(func) or dotted(func)) == k or isinstance(func, ast.Attribute) and \
                (key(func.value) or dotted(func.value)) == k and func.attr not in QUIET | {"state_dict", "parameters"}:
            yield n, "uses it"                           # ema(x), ema.module(x), ema.copy_to(model)
        elif EVALUATES.search(last(n) or "") and any(_names(a, k) for a in [*n.args, *(w.value for w in n.keywords)]):
            yield n, "evaluates it"                      # evaluate(ema.module, loader)
        elif dotted(func) == "torch.save" and any(_names(a, k) for a in [*n.args, *(w.value for w in n.keywords)]):
            yield n, "saves it"   # torch.save({"ema": ema.state_dict()}, path); not helpers that may save on rank 0


def _names(expr, k: str) -> bool:
    return any((key(x) or dotted(x)) == k for x in ast.walk(expr) if isinstance(x, (ast.Name, ast.Attribute)))


@rule("DDP021", "An averaged (EMA/SWA) copy of the model is updated on rank 0 only but evaluated or saved on "
      "every rank: the other ranks use its initial weights, so metrics reduced across ranks and checkpoints "
      "they write mix a trained average with an untrained one.",
      fix="update the average on every rank (the DDP parameters are the same everywhere, so every copy stays "
          "equal), or keep every use of it under the same rank-0 check",
      section="divergence")
def ema_on_rank0(m: Module):
    if not (m.is_ddp and m.multiprocess):
        return
    for k, update in _ema_updates(m):
        guard = m.rank0_only(update)
        if guard is None:
            continue
        for use, what in _ema_uses(m, k, update):
            if m.rank0_only(use) is None and not m.guarded(use):
                harm = "a checkpoint every rank writes may hold an untrained copy" if what == "saves it" else \
                    "whatever they compute from it (a metric reduced across ranks) mixes in an untrained copy"
                yield Hit(update, f"{k} is updated only on rank 0, {_condition(m, update, guard[0])}, but line "
                                  f"{use.lineno} {what} on every rank: the other ranks "
                                  f"hold its initial weights, so {harm}.")
                break


# ------------------------------------------------------------ DDP022: clipping inside no_sync
CLIPS = {"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "clip_grad_value"}


def _no_sync_blocks(m: Module):
    for node in m.nodes:
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(
                isinstance(c, ast.Call) and last(c) == "no_sync" for i in node.items for c in ast.walk(i.context_expr)):
            yield node


@rule("DDP022", "Gradients clipped inside no_sync(): they are this rank's partial, not yet all-reduced sums, "
      "so each rank clips by its own norm and the update is not the clipped global gradient.",
      fix="clip once per optimizer step, after the last micro-batch's backward (the one that all-reduces) and "
          "right before optimizer.step(); with a GradScaler, after scaler.unscale_(optimizer)",
      section="no_sync")
def clip_in_no_sync(m: Module):
    if not m.is_ddp:
        return
    opts, seen = optimizers(m), set()
    for block in _no_sync_blocks(m):
        reached = m.flow.reach(block)
        if any(_is_optimizer_step(c, opts) for c, _ in reached):
            continue   # the step runs unsynchronized too (local SGD): local clipping is what it means
        for call, via in reached:
            if isinstance(call, ast.Call) and last(call) in CLIPS and id(via or call) not in seen:
                seen.add(id(via or call))
                yield Hit(via or call, f"{ast.unparse((via or call).func)}() clips gradients inside `with "
                          f"{ast.unparse(block.items[0].context_expr)}:` (line {block.lineno}): they are this "
                          "rank's partial, not yet all-reduced sums, so each rank clips by its own norm and the "
                          "update is not the clipped global gradient.")
    for loop in m.nodes:
        if isinstance(loop, (ast.For, ast.While)):
            yield from _clip_every_micro_step(m, loop, opts, seen)


def _clip_every_micro_step(m: Module, loop, opts, seen):
    """A clip on every micro-step of a loop whose backward skips the all-reduce on some of them
    (no_sync through a variable context) and whose optimizer steps only when a window closes."""
    inside = [n for s in loop.body for n in ast.walk(s)]
    if not any(isinstance(n, ast.Attribute) and n.attr in ("no_sync", "require_backward_grad_sync") for n in inside):
        return
    windows = [b for b in inside if isinstance(b, ast.If) and _window_test(m, b, loop)
               and any(_is_optimizer_step(c, opts) for s in b.body for c in ast.walk(s))]
    if not windows or not any(_is_backward(c) for c in inside):
        return
    for call in inside:
        if isinstance(call, ast.Call) and last(call) in CLIPS and id(call) not in seen and \
                not any(a in windows for a in m.ancestors(call)):
            seen.add(id(call))
            yield Hit(call, f"{ast.unparse(call.func)}() runs on every micro-step, but the gradients are "
                      f"all-reduced only when the optimizer steps (`if {ast.unparse(windows[0].test)}:`, line "
                      f"{windows[0].lineno}): it clips this rank's partial sums, by a different norm on each rank.")


# ------------------------------------------------------------ DDP023: an early stop on one rank
LEAVES = (ast.Break, ast.Return)
VALIDATION = re.compile(r"val|test|eval|dev", re.I)


def _sync_point(m: Module, loop):
    """The first collective (or backward, whose all-reduce is one) the loop runs, or None."""
    imported = _from_torch_distributed(m)   # dist.all_reduce(t), not tensor.gather(...) or functools.reduce
    found = m.flow.reaches(loop, lambda n: isinstance(n, ast.Call) and (
        _is_world_collective(n, imported, m.imported) or _is_backward(n)))
    return found[0] if found else None


def _handed_to_collective(m: Module, scope) -> set:
    return {x.id for c in m.walk_scope(scope) if isinstance(c, ast.Call) and last(c) in COLLECTIVES
            for a in [*c.args, *(w.value for w in c.keywords)] for x in ast.walk(a) if isinstance(x, ast.Name)}


def _rank_local(m: Module, test, loop, shared: set) -> str | None:
    """Why the test's value may differ by rank, in words, or None."""
    r = m.rank0_test(test)
    if r:
        who = "local rank 0 (one process per node)" if r[0] == "local" else "rank 0"
        return f"true on {who} only" if r[1] else f"true on every rank but {who}"
    scope = m.scope(loop)
    for name in sorted({n.id for n in ast.walk(test) if isinstance(n, ast.Name)} - shared):
        bound = [(v, node) for _, v, node in m.assignments(scope, name)]
        in_loop = [node for _, node in bound if any(a is loop for a in m.ancestors(node))]
        if in_loop and all(m.rank0_only(node) for node in in_loop):   # set before the loop, changed on rank 0
            return f"decided from {name}, which only rank 0 changes (line {in_loop[0].lineno})"
        bound = [(v, node) for v, node in bound if not isinstance(v, ast.Constant)]
        if len(bound) == 1 and _metric(name) and isinstance(bound[0][0], ast.Call) and _local_eval(m, bound[0][0]):
            return (f"decided from {name}, this rank's own result of {ast.unparse(bound[0][0].func)}() (line "
                    f"{bound[0][1].lineno}) on its shard of the validation set, never all-reduced")
    return None


def _local_eval(m: Module, call) -> bool:
    """A function of this file that reaches no collective, in a file that shards its validation set."""
    func = m.flow.target(call)
    if func is None or m.flow.reaches(func, lambda n: isinstance(n, ast.Call) and last(n) in COLLECTIVES):
        return False
    return any(m.is_sampler(c) and c.args and VALIDATION.search(ast.unparse(c.args[0]))
               for c in m.calls)


@rule("DDP023", "A break (or return) out of the training loop taken on some ranks only: the condition comes from this "
      "rank's own values, so the other ranks go on into the next collective and wait there until the timeout.",
      fix="decide on one rank and broadcast the decision (a 0/1 tensor with dist.broadcast, or all-reduce a "
          "stop flag with ReduceOp.MAX), then break on every rank together",
      section="skipped")
def early_stop_one_rank(m: Module):
    if not (m.is_ddp and m.multiprocess):
        return
    for leave in m.nodes:
        if not isinstance(leave, LEAVES):
            continue
        loop = next((a for a in m.ancestors(leave) if isinstance(a, (ast.For, ast.While, ast.FunctionDef,
                                                                     ast.AsyncFunctionDef, ast.Lambda))), None)
        if not isinstance(loop, (ast.For, ast.While)) or m.rank0_only(loop):
            continue
        sync = _sync_point(m, loop)
        if sync is None:
            continue
        shared = _handed_to_collective(m, m.scope(leave))
        for branch, _ in m.branches(leave):
            if not any(a is loop for a in m.ancestors(branch)):
                break
            why = _rank_local(m, branch.test, loop, shared)
            if why:
                into = "backward()'s all-reduce" if _is_backward(sync) else f"{ast.unparse(sync.func)}()"
                yield Hit(leave, f"`{ast.unparse(leave)}` (loop at line {loop.lineno}) is taken where "
                                 f"`{ast.unparse(branch.test)}` holds, {why}: the other ranks go on into "
                                 f"{into} ({m.where(sync)}) and wait there until the timeout.")
                break
