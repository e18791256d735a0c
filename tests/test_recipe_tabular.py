"""docs/train_ddp.md's "Your own data and model", followed literally.

The recipe's ```diff blocks are read from the doc itself and applied to a copy of
scripts/train_ddp.py, so the doc and this test cannot drift apart: a block whose context no longer
matches the script fails here. The copy then trains on scikit-learn's wine data on 2 ranks (gloo)
without `--dataset` (the recipe makes wine the default), and a second launch resumes it. The number
of lines the doc says the recipe changes is measured here, and the doc's table of rungs is checked
against the rungs' code.
"""
import difflib
import json
import re
import subprocess
import sys
from pathlib import Path

from ddp_lab.lessons import ladder
from ddp_lab.engine import launch

DOC = Path(__file__).resolve().parents[1] / "docs" / "train_ddp.md"
SCRIPT = Path(launch.script("train_ddp.py"))


def section(title: str, level: str = "###") -> str:
    """The doc's text from a heading that starts with `title` to the next heading of its level or above."""
    text = DOC.read_text()
    start = text.index(f"\n{level} {title}")
    ends = [m.start() for m in re.finditer(r"\n#{2,%d} " % len(level), text) if m.start() > start]
    return text[start:ends[0] if ends else len(text)]


def recipe_blocks() -> list[str]:
    """The recipe's ```diff blocks, their list-item indentation removed."""
    blocks = re.findall(r"^( *)```diff\n(.*?)^\1```", section("Adapt it to your data"), re.S | re.M)
    return ["\n".join(line[len(indent):] for line in body.splitlines()) for indent, body in blocks]


def apply_block(source: str, block: str) -> str:
    """Apply one diff hunk without line numbers: context and `-` lines must occur exactly once."""
    old, new = [], []
    for line in block.splitlines():
        mark, text = (line[:1], line[1:]) if line else (" ", "")  # an empty line is blank context
        assert mark in " +-", f"not a diff line: {line!r}"
        if mark != "+":
            old.append(text)
        if mark != "-":
            new.append(text)
    old_text, new_text = "\n".join(old) + "\n", "\n".join(new) + "\n"
    assert source.count(old_text) == 1, f"the recipe's block does not match the script once:\n{old_text}"
    return source.replace(old_text, new_text)


def changed_lines(a: str, b: str) -> int:
    """Lines added or removed, blank lines not counted (as ddp_lab.lessons.ladder counts the rungs' diffs)."""
    diff = difflib.unified_diff(a.splitlines(), b.splitlines(), n=0, lineterm="")
    return sum(1 for d in diff if d[:1] in "+-" and not d.startswith(("+++", "---")) and d[1:].strip())


def adapted_script() -> str:
    source = SCRIPT.read_text()
    blocks = recipe_blocks()
    assert len(blocks) == 3
    for block in blocks:
        source = apply_block(source, block)
    return source


def test_the_doc_states_the_number_of_lines_the_recipe_changes():
    (stated,) = re.findall(r"change (\d+) lines", section("Adapt it to your data"))
    assert changed_lines(SCRIPT.read_text(), adapted_script()) == int(stated)


def test_the_rung_table_matches_the_rungs():
    rows = [r for r in section("Which rung to copy").splitlines() if re.match(r"\| \d+ \|", r)]
    assert len(rows) == len(ladder.RUNGS)
    flags_before, source_before = set(), ""
    for row, rung in zip(rows, ladder.RUNGS):
        _, number, file, flags, adds, _ = (cell.strip() for cell in row.split("|"))
        assert file == f"`{rung.file}`", row
        source = ladder.path(rung).read_text()
        own = set(re.findall(r'a\("(--[a-z0-9-]+)"', source))
        listed = set(re.findall(r"`(--[a-z0-9-]+)`", flags))
        assert listed == own - flags_before, f"{rung.file}: the table lists {sorted(listed)}"
        for name in re.findall(r"`([^`]+)`", adds):  # each name is new in this rung's code
            assert name in source and name not in source_before, f"{rung.file}: {name}"
        flags_before |= own
        source_before = source


def test_float64_inputs_stop_with_one_line_naming_the_fix(tmp_path):
    # what a user who builds the tensor without dtype=torch.float32 gets (numpy's float64)
    forgot = adapted_script().replace("torch.tensor(d.data, dtype=torch.float32)", "torch.tensor(d.data)")
    assert forgot.count("torch.tensor(d.data)") == 1
    (tmp_path / "train_wine.py").write_text(forgot)
    proc = subprocess.run([sys.executable, tmp_path / "train_wine.py", "--max-steps", "1", "--progress", "off"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "torch.float64" in errors[0] and "dtype=torch.float32" in errors[0]


def records(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def test_the_adapted_copy_trains_wine_on_two_ranks_and_resumes(tmp_path):
    script = tmp_path / "train_wine.py"
    script.write_text(adapted_script())
    ckpt, first, second = tmp_path / "ck", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    common = ["--epochs", "8", "--log-every", "1", "--ckpt-dir", ckpt, "--progress", "off"]  # no --dataset
    run1 = launch.torchrun(script, nproc=2, stream=False, args=[*common, "--max-steps", "12", "--metrics-out", first])
    run2 = launch.torchrun(script, nproc=2, stream=False, args=[*common, "--metrics-out", second])

    # the recipe made wine the default, and rank 0 (only) says so before training
    assert records(first, "config")[0]["dataset"] == "wine"
    for run in (run1, run2):
        said = [line for lines in run.rank_lines.values() for line in lines
                if "dataset=wine (142 train, 36 val, 3 classes)" in line]
        assert len(said) == 1 and said[0] in run.rank_lines[0], run.log[-2000:]

    # 142 rows over 2 ranks, batch 32: 3 steps per epoch; the first launch stops at step 12
    losses = [r["loss"] for r in records(first, "train")]
    assert len(losses) == 12 and records(first, "final")[0]["step"] == 12
    assert max(losses[-3:]) < losses[0] / 2, losses  # the loss falls (and does not diverge)

    # the second launch resumes at step 12 and finishes the 8 epochs: 24 steps
    (resume,) = records(second, "resume")
    assert resume["step"] == 12 and resume["path"].endswith("last.pt")
    assert [r["step"] for r in records(second, "train")] == list(range(13, 25))
    last = records(second, "eval")[-1]
    # 3 classes, the largest 40% of the data: well above chance, every validation row counted once
    assert last["count"] == 36 and last["acc"] >= 0.85, last
    assert records(second, "final")[0]["step"] == 24
