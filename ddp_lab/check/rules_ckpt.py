"""Rules about checkpoints: who writes, who reads, what the file holds."""
from __future__ import annotations

import ast
import re

from .astutil import dotted, key, last
from .core import Hit, rule
from .pyfacts import DISTRIBUTED_CALLS, Module


def _arg(call: ast.Call, index: int, name: str):
    if len(call.args) > index:
        return call.args[index]
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


def _values(m: Module, node, at):
    """node, and if it is a name, what it was last bound to before `at` in the same scope."""
    yield node
    k = key(node)
    if k:
        before = [v for line, v, _ in m.assignments(m.scope(at), k) if line < at.lineno and v is not None]
        if before:
            yield before[-1]


def _in_memory(m: Module, node, at) -> bool:
    return any(isinstance(c, ast.Call) and (dotted(c.func) or "").endswith("BytesIO")
               for v in _values(m, node, at) for c in ast.walk(v))


def _torch_calls(m: Module, name: str):
    return [c for c in m.calls if dotted(c.func) == f"torch.{name}"]


@rule("DDP013", "torch.save runs on every rank: N processes write the same file at once, and a reader "
      "can see it half-written.",
      fix="save on rank 0 only (`if rank == 0:`), then dist.barrier() before anyone reads the file",
      section="what_to_save")
def save_on_every_rank(m: Module):
    if not (m.runs_distributed and m.multiprocess):
        return
    for call in _torch_calls(m, "save"):
        dest = _arg(call, 1, "f")
        if dest is None or _in_memory(m, dest, call) or any(m.mentions_rank(v) for v in _values(m, dest, call)):
            continue  # a buffer, or a file per rank
        where = m.every_rank_path(call)
        if where is call:
            yield Hit(call)
        elif where is not None:
            func = m.function(call)
            if _program(func):   # main() itself: the rank-0 check goes around its torch.save
                yield Hit(call, f"torch.save runs on every rank: {func.name}() is called on every rank, outside "
                                "any rank-0 check.")
            else:                # a saving helper: the rank-0 check goes around its call
                yield Hit(where, f"torch.save runs on every rank: {func.name}() saves (torch.save, line "
                                 f"{call.lineno}) and is called here on every rank, outside any rank-0 check.")
    if m.project is not None:
        yield from _saves_in_other_file(m)


def _saves_in_other_file(m: Module):
    """A saving helper of another file checked with this one (`utils.save_checkpoint(...)`) that
    calls torch.save outside any rank check, called here on every rank: reported at the call."""
    for call in m.calls:
        func = m.flow.target(call)
        if func is None or m.owner(func) is m:
            continue
        save = _unguarded_save(m.owner(func), func, 2)
        where = m.every_rank_path(call) if save is not None else None
        if where is None:
            continue
        holder = m.function(call)
        at = call if where is call or _program(holder) else where
        yield Hit(at, f"torch.save runs on every rank: {ast.unparse(call.func)}() saves (torch.save, "
                      f"{m.where(save)}) and is called here on every rank, outside any rank-0 check.")


def _unguarded_save(owner: Module, func, depth: int):
    """A torch.save to a shared file that func runs with no rank check on the way, or None."""
    k = ("DDP013", id(func), depth)
    if k not in owner.project.memo:
        owner.project.memo[k] = None
        for n in owner.flow._below(func):
            if not isinstance(n, ast.Call):
                continue
            if dotted(n.func) == "torch.save":
                dest = _arg(n, 1, "f")
                if dest is not None and not _in_memory(owner, dest, n) and not owner.guarded(n) and \
                        not any(owner.mentions_rank(v) for v in _values(owner, dest, n)):
                    owner.project.memo[k] = n
                    break
            elif depth > 0 and (inner := owner.flow.target(n)) is not None and not owner.guarded(n):
                found = _unguarded_save(owner.owner(inner), inner, depth - 1)
                if found is not None:
                    owner.project.memo[k] = found
                    break
    return owner.project.memo[k]


def _program(func) -> bool:
    """A function that is the program rather than a helper: it loops, or sets up the job."""
    return any(isinstance(n, (ast.For, ast.While, ast.AsyncFor)) or (isinstance(n, ast.Call) and last(n) in
               DISTRIBUTED_CALLS) for n in ast.walk(func))


@rule("DDP014", "torch.load without map_location in a CUDA program: tensors saved from cuda:0 load onto "
      "cuda:0 on every rank, so one GPU holds N copies.",
      fix='pass map_location="cpu" (load_state_dict copies to each rank\'s device) or '
          "{'cuda:0': f'cuda:{local_rank}'}",
      section="what_to_save")
def load_without_map_location(m: Module):
    if not (m.runs_distributed and m.uses_cuda and m.multiprocess):
        return
    for call in _torch_calls(m, "load"):
        source = _arg(call, 0, "f")
        if _arg(call, 1, "map_location") is not None or source is None or _in_memory(m, source, call):
            continue
        if m.rank0_only(call) or _saved_here(m, source, call):
            continue  # only rank 0 loads (on its own cuda:0), or this process wrote the file itself
        if any(m.flow.exclusive(call, other) and _arg(other, 1, "map_location") is not None
               for other in _torch_calls(m, "load")):
            continue  # the other branch maps it (`if args.gpu is None: ... else: map_location=loc`)
        if _loads_data(m, call):
            continue  # `dataset, _ = torch.load(cache_path)`: a cached data set, not GPU tensors
        yield Hit(call)


DATA = re.compile(r"^(data(set)?|.*_data(set)?|dataset_\w+|cache\w*|vocab\w*|meta\w*|tokens?|labels?|splits?|index)$", re.I)


def _loads_data(m: Module, call) -> bool:
    """The loaded object is bound to a data set's name (`dataset, _ = torch.load(p)`)."""
    stmt = m.parent.get(call)
    if not isinstance(stmt, ast.Assign):
        return False
    names = [n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name) and n.id != "_"]
    return bool(names) and all(DATA.match(n) for n in names)


def _saved_here(m: Module, source, at) -> bool:
    text = ast.unparse(source)
    return any(c.lineno < at.lineno and (d := _arg(c, 1, "f")) is not None and ast.unparse(d) == text
               for c in _torch_calls(m, "save") if m.scope(c) is m.scope(at))


@rule("DDP015", "The DDP wrapper's state_dict is saved: every key starts with `module.`, so the file "
      "does not load into the plain model.",
      fix="save model.module.state_dict() (the unwrapped model); strip `module.` from old files with "
          "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present",
      section="prefixes")
def saves_wrapper_state(m: Module):
    if any(isinstance(c.func, ast.Attribute) and c.func.attr == "load_state_dict" and m.wrapped(c.func.value, c)
           for c in m.calls):
        return  # the file goes back into a DDP wrapper: `module.` is what the author meant
    for call in _torch_calls(m, "save"):
        obj = _arg(call, 0, "obj")
        if obj is None:
            continue
        for value in _values(m, obj, call):
            for sd in ast.walk(value):
                if isinstance(sd, ast.Call) and isinstance(sd.func, ast.Attribute) and sd.func.attr == "state_dict" \
                        and m.wrapped(sd.func.value, sd):
                    yield Hit(sd, f"{ast.unparse(sd.func.value)} is the DDP wrapper: its state_dict keys start "
                                  "with `module.`, so the file does not load into the plain model.")


@rule("DDP016", "Both branches of this rank check run the same code, so every rank does it: the check "
      "only looks like one.",
      fix="do the work once on rank 0 and share the result (dist.broadcast_object_list), or drop the if",
      section="load")
def identical_rank_branches(m: Module):
    for node in m.nodes:
        if isinstance(node, ast.If) and node.orelse and m.mentions_rank(node.test) and \
                ast.dump(ast.Module(node.body, [])) == ast.dump(ast.Module(node.orelse, [])):
            loads = any(isinstance(c, ast.Call) and dotted(c.func) == "torch.load" for s in node.body for c in ast.walk(s))
            yield Hit(node.test, "Both branches of this rank check run the same code: every rank reads the "
                                 "checkpoint, not rank 0 alone." if loads else None)
