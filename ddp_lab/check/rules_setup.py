"""Rules about setting up: the process group, who is who, wrapping the model (seeding: rules_seed.py)."""
from __future__ import annotations

import ast
import re

from .astutil import dotted, is_ddp_call, key, last
from .core import Hit, rule
from .pyfacts import Module

BATCHNORM = re.compile(r"^(Lazy)?BatchNorm[123]?d?$")
# torchvision constructors whose models contain BatchNorm layers.
BN_MODELS = re.compile(r"^(resnet\d+|resnext\w+|wide_resnet\w+|densenet\d+|mobilenet_v[23]\w*|efficientnet\w*"
                       r"|regnet_\w+|vgg\d+_bn|inception_v3|googlenet|shufflenet_v2\w*|mnasnet\w*)$")


def _backend_arg(call: ast.Call):
    for kw in call.keywords:
        if kw.arg == "backend":
            return kw.value
    return call.args[0] if call.args else None


@rule("DDP001", 'The backend is hard-coded to "nccl": the program cannot run on a CPU or on fewer GPUs '
      "than processes.",
      fix='pick it from the device: backend = "nccl" if torch.cuda.is_available() else "gloo"',
      section="backend")
def hardcoded_nccl(m: Module):
    for call in m.calls:
        if last(call) == "init_process_group":
            arg = _backend_arg(call)
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.lower() == "nccl" \
                    and not m.flow.ensured(call, _asks_for_gpu):
                yield Hit(arg)


def _asks_for_gpu(test) -> bool:
    """A test on the GPUs being there: torch.cuda.is_available(), torch.cuda.device_count()."""
    return any(isinstance(n, ast.Call) and last(n) in ("is_available", "device_count")
               and "cuda" in (dotted(n.func) or "") for n in ast.walk(test))


@rule("DDP002", "init_process_group has no timeout: when one rank dies or stalls, the others wait in "
      "the next collective for the default 10 to 30 minutes instead of failing.",
      fix="pass timeout=datetime.timedelta(seconds=...) (it also bounds every collective)",
      section="hang")
def no_timeout(m: Module):
    for call in m.calls:
        if last(call) == "init_process_group" and not any(kw.arg in ("timeout", None) for kw in call.keywords):
            yield Hit(call)


@rule("DDP003", "LOCAL_RANK used as the process's identity: it is 0 once per node, so on two nodes two "
      "processes pass this check (or read the same shard).",
      fix="use the global rank (int(os.environ['RANK']), dist.get_rank()) for identity; LOCAL_RANK only "
          "picks the device",
      section="identity")
def local_rank_identity(m: Module):
    for node in m.nodes:
        if isinstance(node, ast.If):
            r = m.rank0_test(node.test)
            if r and r[0] == "local" and r[1] and any(_writes_or_prints(n) for s in node.body for n in ast.walk(s)):
                yield Hit(node.test, "LOCAL_RANK used for a rank-0 check before saving or printing: it is 0 "
                                     "once per node, so on two nodes two processes do it.")
    for call in m.calls:
        if m.is_sampler(call):
            for kw in call.keywords:
                if kw.arg == "rank" and m.identity(kw.value) == "local":
                    yield Hit(kw.value, "DistributedSampler(rank=<local rank>): every node reads the same "
                                        "shards, and some shards are never read.")
                if kw.arg == "num_replicas" and any(
                        (isinstance(n, ast.Call) and last(n) == "device_count") or
                        (isinstance(n, ast.Constant) and n.value == "LOCAL_WORLD_SIZE") for n in ast.walk(kw.value)):
                    yield Hit(kw.value, "DistributedSampler(num_replicas=<GPUs on this node>): on several "
                                        "nodes the shards overlap; the job has WORLD_SIZE replicas.")


def _writes_or_prints(node) -> bool:
    if not isinstance(node, ast.Call):
        return False
    return dotted(node.func) == "torch.save" or re.search(r"save|write|dump|print", last(node) or "") is not None


MOVES = {"to", "cuda", "half", "float", "double", "bfloat16"}


# Calls that hand on the module they are given (the same parameters, under a new name).
WRAPPING = {"DDP", "DistributedDataParallel", "FSDP", "FullyShardedDataParallel", "fully_shard", "compile",
            "convert_sync_batchnorm", *MOVES}


def _wrapped_by(call) -> ast.AST | None:
    """The module a wrapping call hands on: `torch.compile(model)`, `DDP(model)`, `model.to(device)`."""
    if not isinstance(call, ast.Call) or last(call) not in WRAPPING:
        return None
    if last(call) in MOVES and isinstance(call.func, ast.Attribute):
        return call.func.value
    return call.args[0] if call.args else None


def _model_key(expr) -> str | None:
    """The name under the wrappers: `model` for `model`, `torch.compile(model)`, `model.to(device)`."""
    while isinstance(expr, ast.Call) and _wrapped_by(expr) is not None:
        expr = _wrapped_by(expr)
    return key(expr)


def _wrap_points(m: Module):
    """(call, [names of the model it is handed]) for each place the model gets wrapped: `DDP(model)`, and
    a call of this file's function that wraps what it is handed (`model = wrap(model)`) or returns a DDP
    wrapper it built (`model = build_ddp(args)`)."""
    for call in m.calls:
        if is_ddp_call(call):
            yield call, [_model_key(call.args[0])] if call.args else []
            continue
        func = m.flow.target(call)
        if func is None or m.owner(func) is not m or not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if any(isinstance(r, ast.Return) and r.value is not None and _returns_ddp(m, func, r.value)
               for r in m.walk_scope(func)):
            yield call, [a.id for a in call.args if isinstance(a, ast.Name)]


def _returns_ddp(m: Module, func, value) -> bool:
    """value (returned by func) is a DDP wrapper: `DDP(...)`, `torch.compile(DDP(...))`, or a name bound to one."""
    if any(is_ddp_call(n) for n in ast.walk(value)):
        return True
    k = _model_key(value)
    return k is not None and any(v is not None and any(is_ddp_call(n) for n in ast.walk(v))
                                 for _, v, _ in m.assignments(func, k))


def _same_model(m: Module, scope, names: set, wrap) -> set:
    """names, and the other names that hold the same module in scope: what was wrapped to make them
    (`compiled = torch.compile(raw)` before `DDP(compiled)`: raw too) and what wraps them afterwards
    (`net = torch.compile(model)`)."""
    names = set(names)
    binds = [(node, key(t), node.value) for node in m.walk_scope(scope) if isinstance(node, ast.Assign)
             for t in node.targets if key(t)]
    changed = True
    while changed:
        changed = False
        for node, k, v in binds:
            inner = _model_key(v) if isinstance(v, (ast.Call, ast.Name)) else None
            if inner is None or inner == k:
                continue
            if k in names and inner not in names and node.lineno <= wrap.lineno:
                names.add(inner)       # model = torch.compile(raw), before the wrap: raw is the model
                changed = True
            elif inner in names and k not in names and node.lineno > wrap.end_lineno:
                names.add(k)           # other = torch.compile(model), after the wrap: other is the wrapper
                changed = True
    return names


@rule("DDP004", "The model is moved or converted after DDP wrapped it: DDP recorded its parameters, "
      "devices and buckets when it was built.",
      fix="finish the model first (.to(device), convert_sync_batchnorm), then wrap it: DDP(model, ...)")
def changed_after_wrap(m: Module):
    for ddp, handed in _wrap_points(m):
        parent = m.parent.get(ddp)
        if isinstance(parent, ast.Attribute) and parent.attr in MOVES:   # DDP(model).to(device)
            yield Hit(parent)
            continue
        names = set(handed)
        if isinstance(parent, ast.Assign):
            names |= {key(t) for t in parent.targets}
        names.discard(None)
        scope = m.scope(ddp)
        names = _same_model(m, scope, names, ddp)
        for call in sorted((c for c in m.walk_scope(scope) if isinstance(c, ast.Call)), key=lambda c: c.lineno):
            if call.lineno <= ddp.end_lineno:
                continue
            target = None
            if isinstance(call.func, ast.Attribute) and call.func.attr in MOVES:      # model.to(device)
                target = key(call.func.value)
            elif last(call) == "convert_sync_batchnorm" and call.args:               # convert_sync_batchnorm(model)
                target = key(call.args[0])
            rewrap = any(is_ddp_call(a) for a in m.ancestors(call))   # DDP(model.cuda()): a new wrapper
            if target in names and not rewrap and not _rebound(m, scope, target, ddp.end_lineno, call.lineno) \
                    and not m.flow.exclusive(ddp, call) and _forward_after(m, scope, names, call.lineno):
                yield Hit(call)
        yield from _changed_in_other_method(m, ddp, names)


def _change_target(call) -> str | None:
    if isinstance(call.func, ast.Attribute) and call.func.attr in MOVES:      # model.to(device)
        return key(call.func.value)
    if last(call) == "convert_sync_batchnorm" and call.args:                  # convert_sync_batchnorm(model)
        return key(call.args[0])
    return None


def _changed_in_other_method(m: Module, ddp, names):
    """`self.model = DDP(...)` in a method that runs first (__init__, or one that calls the other
    after wrapping), and `self.model` moved or converted in another method, then used as a model."""
    wrapper = m.function(ddp)
    cls = m.parent.get(wrapper)
    attrs = {n for n in names if n.startswith("self.")}
    if not attrs or not isinstance(cls, ast.ClassDef):
        return
    methods = [f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f is not wrapper]
    called = {m.flow.target(c): c for c in m.walk_scope(wrapper) if isinstance(c, ast.Call) and m.flow.target(c)}
    used = any(isinstance(c, ast.Call) and (key(c.func) in attrs or (
        isinstance(c.func, ast.Attribute) and key(c.func.value) in attrs and c.func.attr in ("train", "forward")))
        for f in methods for c in m.walk_scope(f))
    for f in methods:
        if f in called:
            runs_after = called[f].lineno > ddp.end_lineno
        else:
            runs_after = wrapper.name == "__init__"
        if not (runs_after and used):
            continue
        for call in sorted((c for c in m.walk_scope(f) if isinstance(c, ast.Call)), key=lambda c: c.lineno):
            target = _change_target(call)
            to_cpu = any(isinstance(a, ast.Constant) and a.value == "cpu" for a in ast.walk(call))  # an export
            if target in attrs and not to_cpu and \
                    not any(is_ddp_call(c) and c.lineno > call.lineno for c in m.walk_scope(f)):
                yield Hit(call)


def _rebound(m: Module, scope, name, after: int, before: int) -> bool:
    """name is bound to something else between the lines (not to a wrapper of itself: `model =
    torch.compile(model)` keeps the model)."""
    return any(after < line < before and not (isinstance(v, ast.Call) and _model_key(v) == name)
               for line, v, _ in m.assignments(scope, name))


def _forward_after(m: Module, scope, names, line: int) -> bool:
    """The model is still used as a model afterwards (a forward call, .train(), parameters()), or
    handed back to the caller (`return model`), who trains it."""
    for n in m.walk_scope(scope):
        if isinstance(n, ast.Return) and n.lineno > line and n.value is not None and _model_key(n.value) in names:
            return True
        if isinstance(n, ast.Call) and n.lineno > line:
            if key(n.func) in names:
                return True
            if isinstance(n.func, ast.Attribute) and key(n.func.value) in names and \
                    n.func.attr in ("train", "parameters", "no_sync", "forward"):
                return True
    return False


def _has_batchnorm(m: Module) -> bool | None:
    """True: the file builds BatchNorm (or a torchvision model with it); None: SyncBatchNorm is used."""
    names = {n.id if isinstance(n, ast.Name) else n.attr for n in m.nodes if isinstance(n, (ast.Name, ast.Attribute))}
    if "SyncBatchNorm" in names or "convert_sync_batchnorm" in names:
        return None
    return any(BATCHNORM.match(n) or BN_MODELS.match(n) for n in names)


@rule("DDP005", "broadcast_buffers=False in a model with BatchNorm: each rank's running statistics "
      "follow its own data and drift apart, so the ranks evaluate different models.",
      fix="drop broadcast_buffers=False and keep the default (forward_sync_buffers=True, the name since torch 2.13; "
          "the old one warns), or convert to SyncBatchNorm before wrapping",
      section="buffers")
def no_buffer_broadcast(m: Module):
    if not _has_batchnorm(m):
        return
    for call in m.calls:
        if is_ddp_call(call):
            for kw in call.keywords:
                if kw.arg in ("broadcast_buffers", "forward_sync_buffers") and \
                        isinstance(kw.value, ast.Constant) and kw.value.value is False:
                    yield Hit(kw)
