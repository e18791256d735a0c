"""A figure a run measured is never typed into a notebook's prose: a cell prints it, or the prose
points at the output. Prose can then never drift from what the cells show after a re-run.

Documented constants (a datasheet's bandwidth, a default from the PyTorch docs, an article's own
figure) may stand in markdown: the paragraph, list item or table row that holds them carries the
marker `<!-- documented -->` (invisible when rendered) and names its source. Everything else that
looks measured (a number with ms, µs, s, GB/s, MB/s, Gb/s, ×/x or %) fails this test, with the
notebook, the cell and the sentence.
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")) + \
    sorted((ROOT / "notebooks" / "solutions").glob("*.ipynb"))
MARKER = "<!-- documented -->"

NUMBER = r"(?<![\w.])\d+(?:[.,]\d+)?"
FIGURE = re.compile(
    rf"{NUMBER}\s?(?:ms|µs|us|ns|s|GB/s|MB/s|Gb/s|GiB/s|MiB/s|%)(?![\w/])"    # 12 ms, 1.5 GB/s, 26%
    rf"|{NUMBER}\s?[x×](?![\w])"                                            # 4.6x, 2×
    rf"|×{NUMBER}")                                                         # ×5.18
HIDDEN = [re.compile(p, re.S) for p in (
    r"\d+(?:\.\d+)?\s?[x×]\s?\d",  # a product or a shape: 512×512, 3 x 32, 14 × 10⁹
    r"```.*?```",              # fenced code
    r"`[^`\n]*`",              # code spans
    r"\$\$.*?\$\$|\$[^$\n]*\$",  # LaTeX
    r"<!--.*?-->",             # HTML comments
    r"\]\([^)]*\)",            # link targets
)]


def blocks(markdown: str) -> list[str]:
    """Paragraphs, list items and table rows: the unit a marker covers."""
    out, current = [], []
    for line in markdown.splitlines():
        starts_item = re.match(r"\s*(?:[-*+]|\d+\.)\s", line) or line.lstrip().startswith("|")
        if not line.strip() or starts_item or line.lstrip().startswith("#"):
            if current:
                out.append("\n".join(current))
            current = [] if not line.strip() else [line]
            if line.lstrip().startswith(("|", "#")):
                out.append(line)
                current = []
        else:
            current.append(line)
    if current:
        out.append("\n".join(current))
    return out


def typed_figures(markdown: str) -> list[tuple[str, str]]:
    """(figure, block) for every measured-looking figure in an unmarked block."""
    without_fences = re.sub(r"```.*?```", "", markdown, flags=re.S)
    found = []
    for block in blocks(without_fences):
        if MARKER in block:
            continue
        text = block
        for pattern in HIDDEN:
            text = pattern.sub(" ", text)
        found += [(m.group(0), block.strip()) for m in FIGURE.finditer(text)]
    return found


def test_the_scanner_tells_typed_figures_from_documented_ones():
    assert [f for f, _ in typed_figures("The step took 12.5 ms, 4.6x faster; 26% of it sync.")] == \
        ["12.5 ms", "4.6x", "26%"]
    assert typed_figures("NVLink 4 moves 450 GB/s per GPU. <!-- documented -->") == []
    assert typed_figures("Run `sleep 5 s` or $2(N-1)/N$ or [the docs](https://x.org/5ms).") == []
    assert typed_figures("A 3x3 kernel, a 0x1f mask, ResNet-50 and 2(N-1)/N bytes.") == []
    assert typed_figures("Layers of 512×512, 3 x 32 samples, 4 nodes × 8 GPUs.") == []
    table = "| link | GB/s |\n|---|---|\n| PCIe | 32 GB/s <!-- documented --> |\n| mine | 1.1 GB/s |"
    assert [f for f, _ in typed_figures(table)] == ["1.1 GB/s"]
    items = "- first 20 ms\n- second 30 ms <!-- documented -->"
    assert [f for f, _ in typed_figures(items)] == ["20 ms"]
    assert [f for f, _ in typed_figures("the fix is ×5.18 faster")] == ["×5.18"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_measured_figure_is_typed_into_markdown(path):
    cells = json.loads(path.read_text())["cells"]
    problems = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "markdown":
            for figure, block in typed_figures("".join(cell["source"])):
                problems.append(f"cell {index}: {figure!r} in: {block[:160]!r}")
    assert not problems, (
        f"{path.name}: figures typed into markdown. Print the sentence from the value in a code cell, "
        f"point at the output, or mark a documented constant with {MARKER} and its source:\n  "
        + "\n  ".join(problems))
