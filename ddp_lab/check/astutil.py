"""Small AST helpers shared by the rules: names of calls and attribute chains, bindings."""
from __future__ import annotations

import ast

DDP_NAMES = {"DDP", "DistributedDataParallel"}


def dotted(node) -> str | None:
    """`torch.cuda.amp.autocast` for that Attribute chain; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def last(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def key(node) -> str | None:
    """A name the rules can follow: `model`, `self.model` (not `a.b.c` or calls)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return None


def is_ddp_call(node) -> bool:
    return isinstance(node, ast.Call) and last(node) in DDP_NAMES


def pairs(target, value):
    """(key, value) for `a = v` and `a, b = v1, v2` (value None when it cannot be paired)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
            for t, v in zip(target.elts, value.elts):
                yield from pairs(t, v)
        else:
            for t in target.elts:
                yield from pairs(t, None)
    else:
        yield key(target), value
