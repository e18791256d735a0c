"""What a program states about itself, read from its structure rather than its names.

- imports: the full name each imported name stands for (`import torch.distributed.checkpoint as
  dcp` makes `dcp.save` torch.distributed.checkpoint.save);
- samplers: DistributedSampler and the classes of the file derived from it, however deep
  (`class Resumable(DistributedSampler)`, `class Mine(Resumable)`);
- collectives: the calls every rank must make: torch.distributed's collectives under any import
  or alias, torch.distributed.checkpoint's save and load, and any object's `.barrier()` (a
  Lightning strategy's, a Fabric's, an Accelerator's `wait_for_everyone()`).
"""
from __future__ import annotations

import ast
import re

from .astutil import dotted, last

SAMPLER = "DistributedSampler"
COLLECTIVES = {"all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter",
               "all_to_all", "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list",
               "gather_object", "scatter_object_list", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "all_reduce_coalesced"}
# torch.distributed.checkpoint: every rank writes (or reads) its shard, and the ranks agree on a plan
CHECKPOINT_CALLS = {"save", "load", "save_state_dict", "load_state_dict", "async_save"}
# an object's method that waits for every rank (Lightning's strategy.barrier(), Accelerate's wait_for_everyone())
BARRIER_METHODS = {"barrier", "monitored_barrier", "wait_for_everyone"}


def imports(nodes) -> dict[str, str]:
    """Local name -> the full dotted name it stands for, for every import among nodes (a file's)."""
    table: dict[str, str] = {}
    for n in nodes:
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.asname:
                    table[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    table[top] = top
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            for a in n.names:
                if a.name != "*":
                    table[a.asname or a.name] = f"{n.module}.{a.name}"
    return table


def full_name(expr, table: dict) -> str | None:
    """`torch.distributed.checkpoint.save` for `dcp.save` (when `dcp` was imported as that); the
    dotted text itself when its first name was not imported; None for anything else."""
    name = dotted(expr)
    if name is None:
        return None
    head, _, rest = name.partition(".")
    base = table.get(head, head)
    return f"{base}.{rest}" if rest else base


def sampler_classes(nodes, table: dict) -> set[str]:
    """The names that build a DistributedSampler: its own (and any alias it was imported under), and
    the classes of this file that derive from it, directly or through each other."""
    names = {SAMPLER} | {k for k, v in table.items() if v.rsplit(".", 1)[-1] == SAMPLER}
    classes = [n for n in nodes if isinstance(n, ast.ClassDef)]
    changed = True
    while changed:
        changed = False
        for c in classes:
            if c.name not in names and any(_base(b) in names for b in c.bases):
                names.add(c.name)
                changed = True
    return names


def _base(expr) -> str | None:
    name = dotted(expr)
    return name.rsplit(".", 1)[-1] if name else None


def collective(call, table: dict, distributed_names: set) -> bool:
    """A call every rank of the default group must make (see the module docstring). distributed_names:
    names imported from torch.distributed (`from torch.distributed import barrier`)."""
    if not isinstance(call, ast.Call):
        return False
    full = full_name(call.func, table) or ""
    name = full.rsplit(".", 1)[-1] if full else last(call)   # `from ... import save as write` is a save
    if full.startswith("torch.distributed.checkpoint.") and name in CHECKPOINT_CALLS:
        return True
    if name in COLLECTIVES and (full.startswith("torch.distributed.") or (
            isinstance(call.func, ast.Attribute) and re.search(r"dist", dotted(call.func.value) or "", re.I)) or (
            isinstance(call.func, ast.Name) and call.func.id in distributed_names)):
        return True
    return isinstance(call.func, ast.Attribute) and name in BARRIER_METHODS
