"""Rules about gradient accumulation and no_sync: backward on every micro-step, the optimizer every k."""
from __future__ import annotations

import ast
import re

from .astutil import dotted, key, last
from .core import Hit, rule
from .pyfacts import Module


def _inner(node):
    """Nodes under node (a loop, a function), not under functions defined inside it."""
    todo = list(ast.iter_child_nodes(node))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(n))


def _is_backward(call) -> bool:
    # loss.backward(), scaler.scale(loss).backward(); not accelerator.backward(loss) (it handles sync)
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "backward" \
        and not call.args


def _is_optimizer_step(call) -> bool:
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "step"):
        return False
    owner = (dotted(call.func.value) or "").lower().rsplit(".", 1)[-1]
    return "sched" not in owner and ("optim" in owner or owner == "opt" or ("scaler" in owner and bool(call.args)))


def _syncs_itself(m: Module) -> bool:
    names = {n.id if isinstance(n, ast.Name) else n.attr for n in m.nodes if isinstance(n, (ast.Name, ast.Attribute))}
    return bool(names & {"no_sync", "require_backward_grad_sync", "accumulate", "Accelerator", "accelerator",
                         "Fabric", "fabric", "deepspeed", "model_engine"})


@rule("DDP010", "Gradient accumulation without no_sync: backward() runs on every micro-step but the "
      "optimizer steps every k, and DDP all-reduces after each backward, so k-1 of every k all-reduces "
      "are wasted.",
      fix="run forward and backward inside `with model.no_sync():` on every micro-step but the last of "
          "each window",
      section="accumulation")
def accumulation_without_no_sync(m: Module):
    if not m.is_ddp or _syncs_itself(m):
        return
    seen = set()
    for node in m.nodes:
        backwards = _steps_every_k(m, node) if isinstance(node, ast.If) else \
            _micro_step_loop(m, node) if isinstance(node, (ast.For, ast.AsyncFor)) else \
            _window_argument(m, node) if isinstance(node, ast.Call) else []
        backwards = [(b, via) for b, via in backwards if m.owner(b) is m or not _helper_syncs(m.owner(b))]
        if backwards:
            first, via = min(backwards, key=lambda p: (p[1] or p[0]).lineno * 10000 + (p[1] or p[0]).col_offset)
            if id(via or first) not in seen:
                seen.add(id(via or first))
                yield Hit(first) if via is None else Hit(via, (
                    f"Gradient accumulation without no_sync: {ast.unparse(via.func)}() runs backward() "
                    f"({m.where(first)}) on every micro-step but the optimizer steps every k, and DDP all-reduces "
                    "after each backward, so k-1 of every k all-reduces are wasted."))


def _steps_every_k(m: Module, branch: ast.If) -> list:
    """(backward call, call in the loop that reaches it or None) of a loop or function whose optimizer
    steps only under `if i % k == 0:` (or after `if i % k: continue`), following this file's calls."""
    if not any(isinstance(b, ast.BinOp) and isinstance(b.op, ast.Mod) for b in ast.walk(branch.test)):
        return []
    owner = next(a for a in m.ancestors(branch) if isinstance(a, (ast.For, ast.While, ast.FunctionDef,
                                                                   ast.AsyncFunctionDef, ast.Module)))
    inside = {id(n) for n, _ in m.flow.reach(branch)}
    skips = len(branch.body) == 1 and isinstance(branch.body[0], ast.Continue)
    reached = m.flow.reach(owner)
    steps = [c for c, _ in reached if _is_optimizer_step(c)]
    if not steps or not all((id(c) in inside) != skips for c in steps):
        return []  # no step here, or an optimizer also steps outside the window (two optimizers, a GAN)
    return [(c, via) for c, via in reached if _is_backward(c) and id(c) not in inside]


def _helper_syncs(owner: Module) -> bool:
    """_syncs_itself for another file checked with this one (asked once per file)."""
    k = ("DDP010", id(owner))
    if k not in owner.project.memo:
        owner.project.memo[k] = _syncs_itself(owner)
    return owner.project.memo[k]


def _window_argument(m: Module, call: ast.Call) -> list:
    """(backward, call) when call hands an every-k test to a function (`loss_scaler(loss, optimizer,
    update_grad=(i + 1) % k == 0)`) that runs backward on every call but steps the optimizer only
    under `if update_grad:`."""
    func = m.flow.target(call)
    if func is None:
        return []
    given = [a for a in [*call.args, *(k.value for k in call.keywords)]
             if any(isinstance(b, ast.BinOp) and isinstance(b.op, ast.Mod) for b in ast.walk(a))]
    if not given:
        return []
    params = [a.arg for a in [*func.args.posonlyargs, *func.args.args]]
    if isinstance(m.parent.get(func), ast.ClassDef):
        params = params[1:]   # self
    gates = {params[i] for i, a in enumerate(call.args) if i < len(params) and a in given} | \
        {k.arg for k in call.keywords if k.value in given}
    flow, steps, backwards = m.flow.flow_of(func), [], []
    for n, via in flow.reach(func):
        if not (_is_optimizer_step(n) or _is_backward(n)):
            continue
        gated = any(isinstance(b, ast.If) and any(isinstance(x, ast.Name) and x.id in gates for x in ast.walk(b.test))
                    for b, in_body in m.branches(via or n))
        (steps if _is_optimizer_step(n) else backwards).append((n, gated))
    if not steps or not all(g for _, g in steps):
        return []
    return [(n, call) for n, g in backwards if not g]


def _micro_step_loop(m: Module, loop) -> list:
    """The backward calls of `for micro_step in range(k): ...backward()` with the optimizer step after it."""
    if not re.search(r"accum|micro", ast.unparse(loop.target) + ast.unparse(loop.iter), re.I):
        return []
    parent = m.parent[loop]
    block = next((getattr(parent, f) for f in ("body", "orelse", "finalbody") if loop in getattr(parent, f, [])), [])
    after = block[block.index(loop) + 1:] if loop in block else []
    if any(_is_optimizer_step(c) for c in _inner(loop)) or \
            not any(_is_optimizer_step(c) for s in after for c in ast.walk(s)):
        return []
    return [(c, None) for c in _inner(loop) if _is_backward(c)]


@rule("DDP011", "no_sync() wraps only backward: DDP decides in forward whether the coming backward "
      "all-reduces, so this saves nothing.",
      fix="put the forward pass inside the same `with model.no_sync():` block as backward",
      section="no_sync")
def no_sync_backward_only(m: Module):
    for node in m.nodes:
        if not isinstance(node, (ast.With, ast.AsyncWith)):
            continue
        models = {ast.unparse(c.func.value) for i in node.items for c in ast.walk(i.context_expr)
                  if isinstance(c, ast.Call) and last(c) == "no_sync" and isinstance(c.func, ast.Attribute)}
        inside = [n for s in node.body for n in ast.walk(s)]
        if models and any(_is_backward(c) for c in inside) and not any(_may_forward(n, models) for n in inside):
            yield Hit(node)  # nothing inside can be the model's forward: it ran before


def _may_forward(node, models) -> bool:
    """The model itself, or a call of something that may be a model (`net(x)`, `self.model(x)`,
    `criterion(...)`), as opposed to method calls on tensors (`loss.backward()`, `out.sum()`)."""
    if isinstance(node, (ast.Name, ast.Attribute)) and ast.unparse(node) in models:
        return True
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id not in ("len", "float", "int", "sum", "min", "max", "print"))
        or (key(node.func) or "").startswith("self."))
