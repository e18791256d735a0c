"""Rules about mixed precision: the deprecated torch.cuda.amp API (a fallback after torch.amp is fine)."""
from __future__ import annotations

import ast
import re

from .astutil import dotted
from .core import Hit, rule
from .pyfacts import Module

DEPRECATED_AMP = re.compile(r"^torch\.(cuda|cpu)\.amp\.(autocast|GradScaler|custom_fwd|custom_bwd)$")


@rule("DDP012", "torch.cuda.amp is deprecated; without CUDA it also switches itself off with a warning "
      "and trains in fp32.",
      fix='use torch.amp: torch.amp.autocast("cuda", dtype=...) and torch.amp.GradScaler("cuda")',
      section="amp")
def deprecated_amp(m: Module):
    for node in m.nodes:
        if not isinstance(node, (ast.Attribute, ast.ImportFrom, ast.Import)) or _fallback(m, node):
            continue
        parent = m.parent.get(node)
        used = (isinstance(parent, ast.Call) and parent.func is node) or \
            (isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in parent.decorator_list)
        if isinstance(node, ast.Attribute) and used and DEPRECATED_AMP.match(dotted(node) or ""):
            yield Hit(node, f"{dotted(node)} is deprecated (use torch.amp); without CUDA it also switches "
                            "itself off with a warning and runs in fp32.")
        elif isinstance(node, ast.ImportFrom) and (node.module in ("torch.cuda.amp", "torch.cpu.amp") or (
                node.module in ("torch.cuda", "torch.cpu") and any(a.name == "amp" for a in node.names))):
            yield Hit(node, f"Importing from {node.module}{'' if node.module.endswith('amp') else '.amp'}, "
                            "which is deprecated (use torch.amp).")
        elif isinstance(node, ast.Import) and any(a.name.startswith(("torch.cuda.amp", "torch.cpu.amp")) for a in node.names):
            yield Hit(node, "Importing torch.cuda.amp, which is deprecated (use torch.amp).")


def _new_amp(node) -> bool:
    """node uses torch.amp (or torch.autocast): `torch.amp.GradScaler`, `from torch.amp import ...`."""
    return any((isinstance(n, ast.Attribute) and re.match(r"torch\.(amp|autocast)\b", dotted(n) or ""))
               or (isinstance(n, ast.ImportFrom) and n.module in ("torch.amp", "torch"))
               for n in ast.walk(node))


def _fallback(m: Module, node) -> bool:
    """node runs only where torch.amp was tried first: in `except` after a try that uses it, in the
    other branch of an if that uses it, or after such an if that returns."""
    if "amp" not in ((dotted(node) or "") if isinstance(node, ast.Attribute) else ast.unparse(node)):
        return False
    child = node
    for a in m.ancestors(node):
        if isinstance(a, ast.ExceptHandler) and _new_amp(ast.Module(m.parent[a].body, [])):
            return True
        if isinstance(a, ast.If) and any(child is s for s in a.orelse) and _new_amp(ast.Module(a.body, [])):
            return True
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            break
        child = a
    return any(isinstance(s, ast.If) and _new_amp(ast.Module(s.body, [])) and s.body and
               isinstance(s.body[-1], (ast.Return, ast.Raise)) for s in m.flow.before(node))
