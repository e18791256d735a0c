"""docs/train_ddp.md's sequence task (dict samples of different lengths, a model called with keywords),
followed literally.

The section's ```diff blocks are applied to a copy of scripts/train_ddp.py (a block whose context no
longer matches fails here), their size is measured against what the doc states, and the copy trains
on 2 ranks (gloo): once straight through, once killed mid-run (every rank SIGKILLed, torchrun restarts
them, they resume from last.pt) and stopped by --max-steps, then resumed by a second launch. The
resumed run must end with the straight run's weights, bit for bit.
"""
import re

import pytest

from ddp_lab.engine import launch
from test_recipe_tabular import SCRIPT, apply_block, changed_lines, records, section

TITLE = "Adapt it to a sequence task"
# 1000 sequences over 2 ranks, batch 32: 16 steps per epoch, 32 in 2 epochs
COMMON = ["--epochs", "2", "--optimizer", "adamw", "--lr", "0.01", "--log-every", "4", "--progress", "off"]


def recipe() -> tuple[str, str]:
    """(the doc's section, the script with the section's ```diff blocks applied)."""
    text = section(TITLE)
    source = SCRIPT.read_text()
    for indent, body in re.findall(r"^( *)```diff\n(.*?)^\1```", text, re.S | re.M):
        source = apply_block(source, "\n".join(line[len(indent):] for line in body.splitlines()))
    return text, source


def test_the_recipe_changes_the_lines_it_states_and_no_loop():
    text, source = recipe()
    (stated,) = re.findall(r"edits change (\d+) lines", text)
    assert changed_lines(SCRIPT.read_text(), source) == int(stated) <= 25
    # only two lines go (the defaults of --dataset and --model): the loops and the loaders stay as they are
    removed = set(SCRIPT.read_text().splitlines()) - set(source.splitlines())
    assert len(removed) == 2 and all(line.startswith('    a("--') for line in removed), removed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("seqtask")
    script = d / "train_tags.py"
    script.write_text(recipe()[1])
    straight = launch.torchrun(script, nproc=2, stream=False, timeout=400,
                               args=[*COMMON, "--metrics-out", d / "straight.jsonl"])
    drill = ["--ckpt-dir", d / "ck", "--save-every", "5", "--metrics-out", d / "resumed.jsonl"]
    killed = launch.torchrun(script, nproc=2, max_restarts=1, stream=False, timeout=400,
                             args=[*COMMON, *drill, "--crash-at-step", "10", "--max-steps", "20"])
    resumed = launch.torchrun(script, nproc=2, stream=False, timeout=400, args=[*COMMON, *drill])
    return d, straight, killed, resumed


def test_the_copy_trains_dict_batches_with_a_keyword_model_on_two_ranks(runs):
    d, straight, _, _ = runs
    said = [line for lines in straight.rank_lines.values() for line in lines if line.startswith("world_size=")]
    assert len(said) == 1 and said[0] in straight.rank_lines[0], straight.log[-2000:]
    assert "model=tagger dataset=tags (1000 train, 200 val, 2 classes)" in said[0], said[0]
    evals = records(d / "straight.jsonl", "eval")
    assert [e["count"] for e in evals] == [200, 200]  # every validation sequence, once
    # tags need the token before: a per-token guess without it scores about 0.5; the GRU learns it
    assert evals[0]["acc"] < evals[-1]["acc"] and evals[-1]["acc"] > 0.85, evals


def test_killed_stopped_and_resumed_equals_straight_bit_for_bit(runs):
    d, straight, killed, _ = runs
    assert "crash-at-step 10: killing rank 0 (attempt 0)" in killed.log
    recs = records(d / "resumed.jsonl", "resume")
    assert [(r["attempt"], r["step"]) for r in recs] == [(1, 10), (0, 20)], recs
    finals = records(d / "resumed.jsonl", "final")
    assert [r["step"] for r in finals] == [20, 32]
    (want,) = records(d / "straight.jsonl", "final")
    assert finals[-1]["params_sha256"] == want["params_sha256"]
    assert finals[0]["params_sha256"] != want["params_sha256"]  # the second launch did train
