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


OPTIMIZERS = re.compile(r"^(SGD|Adam\w*|AdamW|RMSprop|Adagrad|Adadelta|Adafactor|LAMB|Lamb|LARS|Lion|NAdam|RAdam"
                        r"|ZeroRedundancyOptimizer|\w*Optimizer|create_optimizer\w*|build_optimizer\w*)$")


def optimizers(m: Module) -> frozenset:
    """Names (and `self.` attributes) bound to an optimizer, whatever they are called:
    `o = torch.optim.SGD(...)`, `self.solver = build_optimizer(cfg, model)`."""
    if "optimizers" not in m.__dict__:
        m.__dict__["optimizers"] = frozenset(
            key(t) for n in m.nodes if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
            and (OPTIMIZERS.match(last(n.value) or "") or ".optim." in f".{dotted(n.value.func) or ''}.")
            for t in n.targets if key(t))
    return m.__dict__["optimizers"]


def _is_optimizer_step(call, names=frozenset()) -> bool:
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "step"):
        return False
    if key(call.func.value) in names:
        return True
    owner = (dotted(call.func.value) or "").lower().rsplit(".", 1)[-1]
    words = set(owner.split("_"))
    return "sched" not in owner and ("optim" in owner or bool(words & {"opt", "optimiser", "solver"})
                                     or ("scaler" in owner and bool(call.args)))


def _syncs_itself(m: Module) -> bool:
    names = {n.id if isinstance(n, ast.Name) else n.attr for n in m.nodes if isinstance(n, (ast.Name, ast.Attribute))}
    return bool(names & {"no_sync", "require_backward_grad_sync", "accumulate", "Accelerator", "accelerator",
                         "Fabric", "fabric", "deepspeed", "model_engine", "set_requires_gradient_sync"})


@rule("DDP010", "Gradient accumulation without no_sync: backward() runs on every micro-step but the "
      "optimizer steps every k, and DDP all-reduces after each backward, so k-1 of every k all-reduces "
      "are wasted.",
      fix="run forward and backward inside `with model.no_sync():` on every micro-step but the last of "
          "each window",
      section="accumulation")
def accumulation_without_no_sync(m: Module):
    if not m.is_ddp or _syncs_itself(m) or fsdp2(m):   # a fully_shard model: DDP027 says what to write
        return
    for first, via in accumulating_backwards(m):
        yield Hit(first) if via is None else Hit(via, (
            f"Gradient accumulation without no_sync: {ast.unparse(via.func)}() runs backward() "
            f"({m.where(first)}) on every micro-step but the optimizer steps every k, and DDP all-reduces "
            "after each backward, so k-1 of every k all-reduces are wasted."))


def fsdp2(m: Module) -> bool:
    """The file shards a model with FSDP2's fully_shard (which has no no_sync())."""
    return any(last(c) == "fully_shard" for c in m.calls)


def accumulating_backwards(m: Module):
    """(backward, the call that reaches it or None) for each accumulation window whose backward runs on
    every micro-step outside no_sync, while the optimizer steps every k."""
    seen, opts = set(), optimizers(m)
    for node in m.nodes:
        backwards = _steps_every_k(m, node, opts) if isinstance(node, ast.If) else \
            _window_loop(m, node, opts) if isinstance(node, (ast.For, ast.AsyncFor, ast.While)) else \
            _window_argument(m, node, opts) if isinstance(node, ast.Call) else []
        backwards = [(b, via) for b, via in backwards if (m.owner(b) is m or not _helper_syncs(m.owner(b)))
                     and not _under_no_sync(m, b) and not (via is not None and _under_no_sync(m, via))]
        if backwards:
            first, via = min(backwards, key=lambda p: (p[1] or p[0]).lineno * 10000 + (p[1] or p[0]).col_offset)
            if id(via or first) not in seen:
                seen.add(id(via or first))
                yield first, via


def _under_no_sync(m: Module, node) -> bool:
    """node runs inside a `with` whose context manager may be no_sync: `model.no_sync()`, a name bound
    to it (`ctx = model.no_sync if accumulate else nullcontext`, `with ctx():`), a helper (of this file
    or one checked with it) that returns or enters it (`with maybe_sync(model, step % k != 0):`), or
    a helper we cannot read that is handed the DDP model."""
    func = m.function(node)
    for a in m.ancestors(node):
        if a is func:
            return False
        if isinstance(a, (ast.With, ast.AsyncWith)) and any(_gives_no_sync(m, i.context_expr, a) for i in a.items):
            return True
    return False


def _gives_no_sync(m: Module, expr, at, depth: int = 0) -> bool:
    if _names_no_sync(expr):
        return True
    if depth > 2:
        return False
    owner = m.owner(at)
    target = expr.func if isinstance(expr, ast.Call) else expr
    if isinstance(target, ast.Name):   # ctx(), ctx: what the name was bound to before the with
        bound = [v for line, v, _ in owner.assignments(owner.scope(at), target.id)
                 if line <= at.lineno and v is not None]
        if bound and _gives_no_sync(m, bound[-1], at, depth + 1):
            return True
    func = m.flow.flow_of(at).target(expr) if isinstance(expr, ast.Call) else None
    if isinstance(expr, ast.Call) and func is None and depth == 0 and isinstance(target, (ast.Name, ast.Attribute)):
        # a helper we cannot read (imported from a file not checked) handed the DDP model: don't know
        return any(isinstance(a, (ast.Name, ast.Attribute)) and owner.wrapped(a, at)
                   for a in [*expr.args, *(k.value for k in expr.keywords)])
    if func is None:
        return False
    if _names_no_sync(func):
        return True   # the helper enters no_sync itself (`stack.enter_context(model.no_sync())`)
    for n in ast.walk(func):   # what the helper returns, yields or enters: another helper, a name
        values = [n.value] if isinstance(n, (ast.Return, ast.Yield)) and n.value is not None else \
            [i.context_expr for i in n.items] if isinstance(n, (ast.With, ast.AsyncWith)) else []
        if any(_gives_no_sync(m, v, n, depth + 1) for v in values):
            return True
    return False


def _names_no_sync(node) -> bool:
    """`model.no_sync` or `getattr(model, "no_sync")` somewhere under node."""
    return any(n.attr == "no_sync" if isinstance(n, ast.Attribute) else
               isinstance(n, ast.Constant) and n.value == "no_sync" for n in ast.walk(node))


def _modulo(expr) -> bool:
    return any(isinstance(b, ast.BinOp) and isinstance(b.op, ast.Mod) for b in ast.walk(expr))


def _window_test(m: Module, branch: ast.If, owner) -> bool:
    """The test closes a window of iterations: `i % k == 0`, a name bound to such a test (`sync = (i + 1)
    % k == 0`), or a counter compared and then reset inside (`if count == k: ... count = 0`)."""
    if _modulo(branch.test):
        return True
    names = {n.id for n in ast.walk(branch.test) if isinstance(n, ast.Name)}
    scope = m.scope(branch)
    if any(v is not None and _modulo(v) for name in names for _, v, _ in m.assignments(scope, name)):
        return True
    reset = {key(t) for s in branch.body for n in ast.walk(s) if isinstance(n, ast.Assign)
             and isinstance(n.value, ast.Constant) for t in n.targets}
    counted = {key(n.target) for n in ast.walk(owner) if isinstance(n, ast.AugAssign)}
    compared = isinstance(branch.test, ast.Compare) and isinstance(branch.test.ops[0], (ast.Eq, ast.GtE))
    return compared and bool(names & reset & counted)


def _steps_every_k(m: Module, branch: ast.If, opts=frozenset()) -> list:
    """(backward call, call in the loop that reaches it or None) of a loop or function whose optimizer
    steps only when a window closes (`if i % k == 0:`, after `if i % k: continue`, `if count == k:`),
    following this file's calls."""
    owner = next(a for a in m.ancestors(branch) if isinstance(a, (ast.For, ast.While, ast.FunctionDef,
                                                                   ast.AsyncFunctionDef, ast.Module)))
    if not _window_test(m, branch, owner):
        return []
    inside = {id(n) for n, _ in m.flow.reach(branch)}
    skips = len(branch.body) == 1 and isinstance(branch.body[0], ast.Continue)
    reached = m.flow.reach(owner)
    steps = [c for c, _ in reached if _is_optimizer_step(c, opts)]
    if not steps or not all((id(c) in inside) != skips for c in steps):
        return []  # no step here, or an optimizer also steps outside the window (two optimizers, a GAN)
    return [(c, via) for c, via in reached if _is_backward(c) and id(c) not in inside]


def _helper_syncs(owner: Module) -> bool:
    """_syncs_itself for another file checked with this one (asked once per file)."""
    k = ("DDP010", id(owner))
    if k not in owner.project.memo:
        owner.project.memo[k] = _syncs_itself(owner)
    return owner.project.memo[k]


def _window_argument(m: Module, call: ast.Call, opts=frozenset()) -> list:
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
        if not (_is_optimizer_step(n, opts) or _is_backward(n)):
            continue
        gated = any(isinstance(b, ast.If) and any(isinstance(x, ast.Name) and x.id in gates for x in ast.walk(b.test))
                    for b, in_body in m.branches(via or n))
        (steps if _is_optimizer_step(n, opts) else backwards).append((n, gated))
    if not steps or not all(g for _, g in steps):
        return []
    return [(n, call) for n, g in backwards if not g]


def _window_loop(m: Module, loop, opts=frozenset()) -> list:
    """The backward calls of a loop that steps no optimizer, followed by an optimizer step in the same
    block: `for micro_step in range(k): ...backward()`, `for sample in samples: ...`, whatever the names."""
    parent = m.parent[loop]
    block = next((getattr(parent, f) for f in ("body", "orelse", "finalbody") if loop in getattr(parent, f, [])), [])
    after = block[block.index(loop) + 1:] if loop in block else []
    if any(_is_optimizer_step(c, opts) for c in _inner(loop)) or \
            not any(_is_optimizer_step(c, opts) for s in after for c in ast.walk(s)):
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
