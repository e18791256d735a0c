"""Rules about setting up: the process group, who is who, wrapping the model, seeding."""
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
SEED_CALLS = {"manual_seed", "manual_seed_all", "seed"}
SEED_FUNCS = {"seed_everything", "set_seed", "set_random_seed", "setup_seed", "fix_seed", "init_seeds"}
SEED_OWNERS = {"torch", "torch.cuda", "random", "np.random", "numpy.random"}
NOT_A_BUILD = {"DDP", "DistributedDataParallel", "FSDP", "FullyShardedDataParallel", "fully_shard", "compile",
               "convert_sync_batchnorm", "to", "cuda", "half", "float", "double", "bfloat16", "deepcopy", "copy",
               "load_state_dict", "train", "eval", "from_pretrained", "load"}


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
        if last(call) == "DistributedSampler":
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


@rule("DDP004", "The model is moved or converted after DDP wrapped it: DDP recorded its parameters, "
      "devices and buckets when it was built.",
      fix="finish the model first (.to(device), convert_sync_batchnorm), then wrap it: DDP(model, ...)")
def changed_after_wrap(m: Module):
    for ddp in (c for c in m.calls if is_ddp_call(c)):
        parent = m.parent.get(ddp)
        if isinstance(parent, ast.Attribute) and parent.attr in MOVES:   # DDP(model).to(device)
            yield Hit(parent)
            continue
        names = {key(ddp.args[0])} if ddp.args else set()
        if isinstance(parent, ast.Assign):
            names |= {key(t) for t in parent.targets}
        names.discard(None)
        scope = m.scope(ddp)
        for call in sorted((c for c in m.walk_scope(scope) if isinstance(c, ast.Call)), key=lambda c: c.lineno):
            if call.lineno <= ddp.end_lineno:
                continue
            target = None
            if isinstance(call.func, ast.Attribute) and call.func.attr in MOVES:      # model.to(device)
                target = key(call.func.value)
            elif last(call) == "convert_sync_batchnorm" and call.args:               # convert_sync_batchnorm(model)
                target = key(call.args[0])
            if target in names and not _rebound(m, scope, target, ddp.end_lineno, call.lineno) \
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
    return any(after < line < before for line, _, _ in m.assignments(scope, name))


def _forward_after(m: Module, scope, names, line: int) -> bool:
    """The model is still used as a model afterwards (a forward call, .train(), parameters())."""
    for n in m.walk_scope(scope):
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


def _seeds(call) -> bool:
    if not isinstance(call, ast.Call):
        return False
    owner = dotted(call.func.value) if isinstance(call.func, ast.Attribute) else None
    return last(call) in SEED_FUNCS or (last(call) in SEED_CALLS and owner in SEED_OWNERS)


def _seed_call(m: Module, call: ast.Call) -> bool:
    """A seed call, or a call of this file's function that seeds (`fix_random_seeds`, `seed_all`)."""
    func = m.flow.target(call)
    return _seeds(call) or (func is not None and m.flow.reaches(func, _seeds) is not None)


def _per_rank(m: Module, call: ast.Call) -> bool:
    """An argument mentions the rank, directly or through a name bound to it (`seed = s + rank`)."""
    scope = m.scope(call)
    for arg in [*call.args, *(k.value for k in call.keywords)]:
        if m.mentions_rank(arg):
            return True
        if isinstance(arg, ast.Name):
            before = [v for line, v, _ in m.assignments(scope, arg.id) if line < call.lineno]
            if before and before[-1] is not None and m.mentions_rank(before[-1]):
                return True
    return False


def _builds_model(node) -> bool:
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Call)):
        return False
    target, call = key(node.targets[0]) or "", node.value
    while isinstance(call.func, ast.Attribute) and call.func.attr in MOVES and isinstance(call.func.value, ast.Call):
        call = call.func.value   # build_model().to(device): the build is the inner call
    return bool(re.search(r"model|(^|_|\.)net(work)?$|backbone", target, re.I)) and last(call) not in NOT_A_BUILD


def _wraps_given_model(m: Module, node) -> bool:
    """`model = wrap_model(args, raw_model, device)`: a call of this file's function that is handed a model
    and reaches DDP(...) wraps what was built before; `model = setup_model(args)`, handed none, builds."""
    if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
        return False
    call = node.value
    handed = any(isinstance(a, ast.Name) and re.search(r"model|(^|_)net(work)?$", a.id, re.I)
                 for a in [*call.args, *(k.value for k in call.keywords)])
    func = m.flow.target(call)
    return handed and func is not None and m.flow.reaches(func, is_ddp_call) is not None


@rule("DDP006", "A per-rank seed before the model is built: the ranks build different initial weights. "
      "DDP copies rank 0's parameters and buffers when it wraps the model, nothing else (a random split, "
      "an EMA or teacher copy, a model you never wrap).",
      fix="seed every rank the same, build the model, then reseed with seed + rank for dropout and "
          "augmentation",
      section="seeds")
def per_rank_seed_first(m: Module):
    for call in m.calls:
        if not ((_seeds(call) or m.flow.target(call)) and _per_rank(m, call) and _seed_call(m, call)):
            continue
        scope = m.scope(call)
        later = sorted((n for n in m.walk_scope(scope) if getattr(n, "lineno", 0) > call.end_lineno
                        and isinstance(n, (ast.Call, ast.Assign))), key=lambda n: n.lineno)
        for n in later:
            if isinstance(n, ast.Call) and (_seeds(n) or m.flow.target(n)) and _seed_call(m, n) \
                    and not _per_rank(m, n):
                break   # reseeded the same on every rank first
            built = (_builds_model(n) and not _wraps_given_model(m, n)) or \
                (isinstance(scope, ast.Module) and _call_builds_model(m, n))
            if built:   # here, or (a seed at module level) inside main() called after it
                yield Hit(call)
                break
            if built is None:
                break


def _call_builds_model(m: Module, call) -> bool | None:
    """The function call runs builds a model (True), reseeds the same on every rank first (None),
    or neither (False)."""
    func = m.flow.target(call) if isinstance(call, ast.Call) else None
    for n, _ in m.flow.reach(func) if func is not None else []:
        if _seeds(n) and not _per_rank(m.owner(n), n):
            return None
        if _builds_model(n):
            return True
    return False
