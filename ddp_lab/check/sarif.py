"""`ddp-lab check --format sarif`: SARIF 2.1.0, the format GitHub code scanning and most CI
dashboards read (one run, every rule in tool.driver.rules, one result per finding).

Paths are written relative to the current folder (the repository root in CI), with `/`. A
notebook's findings point at the .ipynb file, line 1, and say the cell and line in the message.
"""
from __future__ import annotations

import os
from pathlib import Path

from .core import RULES

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def uri(path: str) -> str:
    """`src/train.py` for a file under the current folder; a file:// URI for one elsewhere."""
    p, here = Path(path).resolve(), Path.cwd().resolve()
    return Path(os.path.relpath(p, here)).as_posix() if p.is_relative_to(here) else p.as_uri()


def _rule(r) -> dict:
    return {"id": r.id, "name": r.id,
            "shortDescription": {"text": r.sentence},
            "fullDescription": {"text": r.sentence},
            "help": {"text": f"Fix: {r.fix}\nSee: {r.see}",
                     "markdown": f"**Fix:** {r.fix}\n\n**See:** {r.see}"},
            "defaultConfiguration": {"level": "warning"},
            "properties": {"tags": ["ddp", "correctness"], "kind": r.kind}}


def _result(f, index: dict) -> dict:
    notebook = f.cell is not None
    region = {"startLine": 1, "startColumn": 1} if notebook else {"startLine": f.line, "startColumn": max(f.col, 1)}
    where = f"cell {f.cell}, line {f.line}: " if notebook else ""
    artifact = {"uri": uri(f.path)}
    if not artifact["uri"].startswith("file:"):
        artifact["uriBaseId"] = "%SRCROOT%"
    result = {"ruleId": f.id, "ruleIndex": index[f.id], "level": "warning",
              "message": {"text": f"{where}{f.message} Fix: {f.fix}"},
              "locations": [{"physicalLocation": {"artifactLocation": artifact, "region": region}}]}
    if notebook:
        result["properties"] = {"cell": f.cell, "lineInCell": f.line, "columnInCell": f.col}
    return result


def document(findings, errors, version: str = "0") -> dict:
    rules = sorted(RULES.values(), key=lambda r: r.id)
    index = {r.id: i for i, r in enumerate(rules)}
    notes = [{"level": "error", "message": {"text": f"{path}: {message}"},
              "locations": [{"physicalLocation": {"artifactLocation": {"uri": uri(path)}}}]} for path, message in errors]
    return {"$schema": SCHEMA, "version": "2.1.0", "runs": [{
        "tool": {"driver": {"name": "ddp-lab check", "version": version,
                            "rules": [_rule(r) for r in rules]}},
        "originalUriBaseIds": {"%SRCROOT%": {"uri": Path.cwd().as_uri() + "/"}},
        "invocations": [{"executionSuccessful": not errors, "toolExecutionNotifications": notes}],
        "results": [_result(f, index) for f in findings],
    }]}
