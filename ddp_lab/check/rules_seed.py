"""DDP006: a per-rank seed that reaches the model's initialisation or a random data split."""
from __future__ import annotations

import ast
import re

from .astutil import dotted, is_ddp_call, key, last
from .core import Hit, rule
from .pyfacts import Module
from .rules_setup import _wrapped_by

SEED_CALLS = {"manual_seed", "manual_seed_all", "seed"}
SEED_FUNCS = {"seed_everything", "set_seed", "set_random_seed", "setup_seed", "fix_seed", "init_seeds"}
SEED_OWNERS = {"torch", "torch.cuda", "random", "np.random", "numpy.random"}
NOT_A_BUILD = {"DDP", "DistributedDataParallel", "FSDP", "FullyShardedDataParallel", "fully_shard", "compile",
               "convert_sync_batchnorm", "to", "cuda", "half", "float", "double", "bfloat16", "deepcopy", "copy",
               "load_state_dict", "train", "eval", "from_pretrained", "load"}


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
    while isinstance(_wrapped_by(call), ast.Call):
        call = _wrapped_by(call)   # build_model().to(device), DDP(Net()): the build is the inner call
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


SPLITS = {"random_split"}
WRAPS = {"DDP", "DistributedDataParallel", "FSDP", "FullyShardedDataParallel", "fully_shard"}
SECOND_MODEL = re.compile(r"model|teacher|student|backbone|encoder|decoder|critic|discriminator|generator", re.I)
SETTING = re.compile(r"(cfg|config|conf|args|name|path|dir|kwargs|type|id)$", re.I)   # model_cfg: not a model
DDP006_TAIL = ("DDP copies rank 0's parameters and buffers when it wraps the model, nothing else (a random split, "
               "an EMA or teacher copy, a model you never wrap).")


@rule("DDP006", "A per-rank seed before the model is built: the ranks build different initial weights. "
      "DDP copies rank 0's parameters and buffers when it wraps the model, nothing else (a random split, "
      "an EMA or teacher copy, a model you never wrap).",
      fix="seed every rank the same, build the model, then reseed with seed + rank for dropout and "
          "augmentation",
      section="seeds")
def per_rank_seed_first(m: Module):
    groups: dict = {}   # (scope, seed as written) -> its seed calls: one finding per seed, not per call
    for call in m.calls:
        if (_seeds(call) or m.flow.target(call)) and _per_rank(m, call) and _seed_call(m, call):
            groups.setdefault((id(m.scope(call)), _seed_text(m, call)), []).append(call)
    for calls in groups.values():
        calls.sort(key=lambda c: (c.lineno, c.col_offset))
        for call in calls:
            reached = _first_build(m, call, m.scope(call))
            if reached is not None:
                yield Hit(call, _seed_message(m, call, reached, [c.lineno for c in calls if c is not call]))
                break


def _seed_message(m: Module, call, reached, others: list) -> str:
    node, what = reached
    also = f"; also set on line{'s' * (len(others) > 1)} {', '.join(map(str, others))}" if others else ""
    seed = f"{_seed_text(m, call)}{also}"
    if what == "split":
        return (f"A per-rank seed ({seed}) before a random split ({m.where(node)}): each rank splits the data "
                f"differently, so the ranks' training and validation sets overlap. {DDP006_TAIL}")
    return (f"A per-rank seed ({seed}) before the model is built ({m.where(node)}): the ranks build different "
            f"initial weights. {DDP006_TAIL}")


def _seed_text(m: Module, call) -> str:
    """The seed a call sets, as written (`42 + rank`, `seed`)."""
    args = [*call.args, *(k.value for k in call.keywords)]
    return ast.unparse(next((a for a in args if m.mentions_rank(a) or isinstance(a, ast.Name)), args[0])) \
        if args else ast.unparse(call)


def _first_build(m: Module, call, scope):
    """(node, "model" | "split") for the first model built or data split made after the seed call in its
    scope (or in a function called there), or None when the code reseeds the same first, or when the
    seed comes after the model was wrapped and nothing but a second model of its own can follow."""
    wrapped = any(n.lineno < call.lineno for n in _wraps_in(m, scope))
    later = sorted((n for n in m.walk_scope(scope) if getattr(n, "lineno", 0) > call.end_lineno
                    and isinstance(n, (ast.Call, ast.Assign))), key=lambda n: n.lineno)
    for n in later:
        if isinstance(n, ast.Call) and (_seeds(n) or m.flow.target(n)) and _seed_call(m, n) \
                and not _per_rank(m, n):
            return None   # reseeded the same on every rank first
        if _splits(n):
            return n, "split"
        if _builds_model(n) and not _wraps_given_model(m, n) and not _copies_model(m, n, scope) \
                and (not wrapped or SECOND_MODEL.search(key(n.targets[0]) or "")):
            return n, "model"
        inside = _call_builds_model(m, n) if isinstance(scope, ast.Module) and not wrapped else False
        if inside:   # a seed at module level, the model built inside main() called after it
            return inside, "model"
        if inside is None:
            return None
    return None


def _wraps_in(m: Module, scope):
    """The DDP/FSDP wraps in scope, direct or through a function of this file."""
    for n in m.walk_scope(scope):
        if isinstance(n, ast.Call) and (last(n) in WRAPS or (
                m.flow.target(n) is not None and m.flow.reaches(m.flow.target(n), is_ddp_call) is not None)):
            yield n


def _splits(node) -> bool:
    """`train, val = random_split(ds, [a, b])` with no generator of its own: the global RNG decides."""
    call = node.value if isinstance(node, ast.Assign) else None
    return isinstance(call, ast.Call) and last(call) in SPLITS and not any(k.arg == "generator" for k in call.keywords) \
        and len(call.args) < 3


def _copies_model(m: Module, node, scope) -> bool:
    """`ema = ModelEma(model)`, `swa = AveragedModel(model)`: handed a model that exists already, it
    copies its weights instead of drawing new ones."""
    call = node.value
    for a in [*call.args, *(k.value for k in call.keywords)]:
        k = key(a)
        if k and re.search(r"model|(^|_)net(work)?$", k, re.I) and not SETTING.search(k) and \
                any(line < node.lineno for line, _, _ in m.assignments(scope, k)):
            return True
    return False


def _call_builds_model(m: Module, call):
    """The function call runs builds a model (the build), reseeds the same on every rank first (None),
    or neither (False)."""
    func = m.flow.target(call) if isinstance(call, ast.Call) else None
    for n, _ in m.flow.reach(func) if func is not None else []:
        if _seeds(n) and not _per_rank(m.owner(n), n):
            return None
        if _builds_model(n):
            return n
    return False
