"""The lessons: one module per topic, a subpackage where a topic needs several modules.

The programs the lessons launch live in ddp_lab/experiments/ (one small torchrun program per probe).
"""
from __future__ import annotations


def plural(n, word: str, many: str | None = None) -> str:
    """"1 GPU", "2 GPUs", "0 GPUs": the count and the word it needs (`many` for irregular plurals)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"
