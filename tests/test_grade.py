"""ddp_lab.grade: every right answer passes, every typical mistake fails with its own hint.

The answers run the way a notebook's grade.check runs them: on real ranks, in one launch per
rank count (3 ranks for the ring, 2 for the others; the ring's hanging answer costs a second
launch, after its 10 s timeout), or in this process for the exercises graded in the kernel. The registry is checked against the notebooks and the docs.
"""
import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from grade_fixtures import (nb01_gradients, nb01_synced, nb02_evaluation, nb02_exact, nb03_bytes, nb03_ring,
                            nb04_clip, nb04_plan, nb05_accumulation, nb05_lr, nb06_atomic, nb06_checkpoint,
                            nb07_diff, nb07_unused, nb08_exposed, nb08_predict, nb09_memory, nb09_zero1, nb10_batch,
                            nb10_torchrun, nb11_bf16, nb11_hook, nb12_ddp, nb12_fsdp, nb12_speed, nb12_syncbn, nb12_zero)

from ddp_lab import grade
from ddp_lab.grade import core
from ddp_lab.grade import store as progress

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = {"01.4": nb01_gradients, "01.5": nb01_synced, "02.4": nb02_evaluation, "02.5": nb02_exact,
            "03.5": nb03_ring, "03.6": nb03_bytes, "04.4": nb04_clip, "04.5": nb04_plan,
            "05.4": nb05_accumulation, "05.5": nb05_lr, "06.4": nb06_checkpoint, "06.5": nb06_atomic,
            "07.1": nb07_diff, "07.3": nb07_unused,
            "08.4": nb08_exposed, "08.5": nb08_predict, "09.5": nb09_zero1, "09.6": nb09_memory,
            "10.5": nb10_torchrun, "10.6": nb10_batch,
            "11.1": nb11_bf16, "11.2": nb11_hook,
            "12.1": nb12_ddp, "12.2": nb12_speed, "12.3": nb12_zero, "12.4": nb12_syncbn, "12.5": nb12_fsdp}
# A timed exercise's right answer gets a timing's verdict (passed, or blocked where the machine cannot
# judge): its rules are tested on given timings below; its wrong answers are decided before any timing.
TIMED = {"12.2"}
CASES = [(eid, "good", None) for eid in FIXTURES if eid not in TIMED] + \
        [(eid, name, hint) for eid, mod in FIXTURES.items() for name, (_, hint) in mod.MISTAKES.items()]
# A right answer passes whether it computes in float32 (torch's default) or float64: each numeric
# exercise's fixture has PRECISIONS = {"float32": answer, "float64": answer}. These hand in no float:
NO_FLOATS = {"01.5": "names of state_dict entries", "02.5": "sample indices",
             "04.5": "a dtype name and a flag", "06.4": "a checkpoint, compared bit for bit",
             "06.5": "a file written atomically", "07.1": "names of changed entries",
             "07.3": "parameter names", "10.5": "torchrun's arguments", "11.1": "yes or no",
             "12.2": "a timing's verdict"}
PRECISION_CASES = [(eid, dtype) for eid, mod in FIXTURES.items() for dtype in getattr(mod, "PRECISIONS", {})]


@pytest.fixture(autouse=True)
def grades_file(tmp_path, monkeypatch):
    path = tmp_path / "grades.json"
    monkeypatch.setenv(progress.GRADES_ENV, str(path))
    return path


@pytest.fixture(scope="module")
def graded():
    import os
    from ddp_lab.grade.exercises import nb12_speed as speed
    before = os.environ.get(speed.CORES_ENV)
    os.environ[speed.CORES_ENV] = "64"  # the ranks judge the timed exercise's wrong answers as if on a big machine
    try:
        return _graded()
    finally:
        os.environ.pop(speed.CORES_ENV) if before is None else os.environ.__setitem__(speed.CORES_ENV, before)


def _graded():
    items = [(eid, f"{eid} good", mod.good) for eid, mod in FIXTURES.items() if eid not in TIMED]
    items += [(eid, f"{eid} in {dtype}", FIXTURES[eid].PRECISIONS[dtype]) for eid, dtype in PRECISION_CASES]
    items += [(eid, f"{eid} {name}", answer) for eid, mod in FIXTURES.items()
              for name, (answer, _) in mod.MISTAKES.items()]
    return grade.check_all(items)


@pytest.mark.parametrize("exercise_id, name, hint", CASES, ids=[f"{e} {n}" for e, n, _ in CASES])
def test_answer_gets_its_verdict(graded, exercise_id, name, hint):
    result = graded[f"{exercise_id} {name}"]
    if hint is None:
        assert result.passed, str(result)
    else:
        assert result.passed is False and hint in str(result), str(result)
        assert len(str(result).splitlines()) <= 8  # one short block, not a traceback


@pytest.mark.parametrize("exercise_id, dtype", PRECISION_CASES, ids=[f"{e} {d}" for e, d in PRECISION_CASES])
def test_right_answer_passes_in_float32_and_float64(graded, exercise_id, dtype):
    result = graded[f"{exercise_id} in {dtype}"]
    assert result.passed, str(result)


def test_every_numeric_exercise_is_graded_in_both_precisions():
    numeric = {eid for eid, _ in PRECISION_CASES}
    assert numeric | set(NO_FLOATS) == set(grade.REGISTRY) and not numeric & set(NO_FLOATS)
    assert all(set(FIXTURES[eid].PRECISIONS) == {"float32", "float64"} for eid in numeric)


def test_accuracy_in_float32_is_judged_by_its_value_and_a_miss_says_the_tolerance():
    import numpy as np
    ex = grade.REGISTRY["02.4"]
    as_float32 = lambda v: {r: {"value": float(np.float32(v)), "world": 2} for r in range(2)}  # noqa: E731
    assert core.judge(ex, as_float32(7 / 11)) == []
    padded = core.judge(ex, as_float32(8 / 12))
    assert len(padded) == 1 and "the padding was counted" in padded[0], padded
    assert "compared within 1e-6 of its size, which float32 and float64 both meet" in padded[0]


def test_world_size_division_gets_its_own_hint_not_the_step_one(graded):
    text = str(graded["05.4 divides by the world size"])
    assert "divided by the world size (2), not by K = 4" in text, text
    assert "optimizer.step()" not in text and "zero_grad" not in text, text


def test_every_exercise_has_fixtures():
    assert set(FIXTURES) == set(grade.REGISTRY)
    assert all(len(mod.MISTAKES) >= 3 for mod in FIXTURES.values())


def _ids_in(path: Path) -> set:
    text = "".join(c["source"] if isinstance(c["source"], str) else "".join(c["source"])
                   for c in json.loads(path.read_text())["cells"])
    return set(re.findall(r"grade\.check\(\s*[\"'](\d\d[b]?\.\d+)[\"']", text))


def test_notebooks_registry_and_docs_agree():
    docs = (ROOT / "docs" / "exercises.md").read_text()
    used = {}
    for nb in sorted((ROOT / "notebooks").glob("**/*.ipynb")):
        for eid in _ids_in(nb):
            used.setdefault(eid, []).append(nb)
    for eid, ex in grade.REGISTRY.items():
        names = [p.name for p in used.get(eid, [])]
        assert f"{ex.notebook}.ipynb" in names and f"{ex.notebook}_solutions.ipynb" in names, (eid, names)
        assert f"`{eid}`" in docs, f"{eid} is not listed in docs/exercises.md"
    assert set(used) <= set(grade.REGISTRY), set(used) - set(grade.REGISTRY)


def test_unfilled_stub_is_not_attempted_and_records_nothing(capsys, grades_file):
    def ring_allreduce_mean(tensor):
        """Your code here."""
        ...

    result = grade.check("03.5", ring_allreduce_mean)
    assert result.passed is None and "not attempted yet" in capsys.readouterr().out
    assert grade.check("06.4", (nb06_checkpoint.save, None)).passed is None
    assert not grades_file.exists()
    assert not core.is_stub(nb03_ring.good) and not core.is_stub(lambda t: t)


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(KeyError, match="03.5"):
        grade.check("99.9", nb03_ring.good)


def test_progress_keeps_a_pass_and_reads_the_file_given(grades_file, capsys):
    ex = grade.REGISTRY["05.4"]
    progress.record(ex, True)
    progress.record(ex, False)  # a later failed try does not undo the pass
    progress.record(grade.REGISTRY["02.4"], False)
    assert grade.progress() is None  # printed once: nothing for a notebook cell to echo
    table = grade.table()
    assert table["05_gradient_accumulation"]["05.4"] == "passed"
    assert table["02_sampler_and_metrics"]["02.4"] == "tried"
    assert table["09_beyond_ddp"]["09.5"] == "not attempted"
    out = capsys.readouterr().out
    assert "05_gradient_accumulation" in out and str(grades_file) in out
    assert json.loads(grades_file.read_text())["05.4"]["last"] == "failed"


# Two kernels recording at once (two notebooks open): each process records its own exercises, many
# times over; every verdict is in the file afterwards, which is whole, with no temporary file left.
RECORDER = """
import sys
from ddp_lab import grade
from ddp_lab.grade import store
ids = sys.argv[1:]
for i in range(40):
    store.record(grade.REGISTRY[ids[i % len(ids)]], True)
"""


def test_two_kernels_recording_at_once_lose_no_verdict(grades_file):
    import subprocess
    import sys
    mine = [["05.4", "02.4"], ["09.5", "10.5"]]
    procs = [subprocess.Popen([sys.executable, "-c", RECORDER, *ids], cwd=ROOT) for ids in mine]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    grades = json.loads(grades_file.read_text())
    assert sorted(grades) == sorted(sum(mine, [])) and all(g["passed"] for g in grades.values())
    assert sorted(p.name for p in grades_file.parent.iterdir()) == ["grades.json", "grades.json.lock"]


def test_unreadable_grades_file_says_what_to_do(grades_file):
    grades_file.write_text("{not json")
    with pytest.raises(RuntimeError, match="delete it or point DDP_LAB_GRADES"):
        grade.table()
    assert grades_file.read_text() == "{not json"  # nothing overwritten


def scaled_sum(tensor):
    return torch.distributed.is_available() and (tensor * 3).sum().item()


def test_source_fallback_rebuilds_the_function():
    """Without cloudpickle an answer travels as its source, run with torch and dist imported."""
    blob = pickle.dumps(("source", core._sources((scaled_sum, 7))))
    rebuilt, value = core.unpack(blob)
    assert rebuilt is not scaled_sum and rebuilt(torch.ones(4)) == 12.0 and value == 7


def test_one_line_per_finding_shared_by_ranks():
    lines = core.merge_ranks(["rank 0's result is 3x", "rank 1's result is 3x", "rank 1 sent 5"], 2)
    assert lines == ["every rank's result is 3x", "rank 1 sent 5"]


def test_accuracy_task_tells_every_mistake_from_the_exact_value():
    from ddp_lab.grade.exercises import nb02_evaluation as ev
    exact = len(ev.CORRECT) / ev.N_SAMPLES
    wrong = {name: value for name, (value, _) in ev._wrong_answers(2).items()}
    assert all(abs(v - exact) > 1e-3 for v in wrong.values()), wrong
    assert len({round(v, 6) for v in wrong.values()}) >= 4  # padded == mean of padded means here


# The honest statuses: a criterion this machine cannot judge is blocked, never passed by default and
# never failed by noise, and says why; progress() and `ddp-lab grade --json` show it.

def test_a_timing_on_too_few_cores_is_blocked_with_the_reason(grades_file, monkeypatch, capsys):
    from ddp_lab.grade.exercises import nb12_speed as speed
    monkeypatch.setenv(speed.CORES_ENV, "2")
    result = grade.check("12.2", nb12_ddp.good)
    assert result.status == "blocked" and result.passed is None and not result.problems
    assert "needs at least 4 CPU cores for 2 ranks" in str(result) and "gives 2" in str(result)
    assert "neither passed nor failed" in str(result)
    assert json.loads(grades_file.read_text())["12.2"]["last"] == "blocked"
    assert grade.table()["12_build_it"]["12.2"] == "blocked"
    grade.progress()
    assert "12.2 ⊘" in capsys.readouterr().out


def test_an_exercise_this_machine_cannot_judge_is_not_run(monkeypatch):
    ex = core.Exercise(id="99.1", notebook="99_x", title="A GPU-only check", skills="", answer="", nproc=2,
                       on_rank=lambda *a: pytest.fail("ran"), judge=lambda o: [], blocked=lambda: "needs CUDA")
    monkeypatch.setitem(core.REGISTRY, "99.1", ex)
    result = grade.check_all([("99.1", "x", lambda: 1)])["x"]
    assert (result.status, result.passed, result.blocked) == ("blocked", None, "needs CUDA")


def test_a_blocked_try_does_not_undo_a_pass(grades_file):
    ex = grade.REGISTRY["12.2"]
    progress.record(ex, "passed")
    progress.record(ex, "blocked")
    assert grade.table()["12_build_it"]["12.2"] == "passed"
    with pytest.raises(ValueError, match="passed, failed or blocked"):
        progress.record(ex, "maybe")


GOOD_WEIGHTS = [{"copies": 0.0, "moved": 0.1, "ranks_agree": True}] * 7


@pytest.mark.parametrize("ratios, status, said", [
    ([1.30, 1.25, 1.28, 1.35, 1.27, 1.31, 1.29], "passed", ""),
    ([0.70, 0.72, 0.69, 0.75, 0.71, 0.70, 0.73], "failed", "slower than communicating after backward"),
    ([1.02, 0.97, 1.08, 0.93, 1.05, 0.99, 1.10], "blocked", "within the noise"),
    ([1.01, 1.02, 1.01, 1.02, 1.01, 1.02, 1.01], "blocked", "within the noise"),  # steady, but under 3 %
], ids=["clear gain", "clear loss", "noisy", "too small"])
def test_the_timing_rule_passes_a_clear_gain_only(ratios, status, said):
    from ddp_lab.grade.core import Blocked
    from ddp_lab.grade.exercises.nb12_speed import verdict
    found = verdict(ratios, GOOD_WEIGHTS)
    got = "passed" if not found else "blocked" if all(isinstance(f, Blocked) for f in found) else "failed"
    assert got == status and said in " ".join(found), found


@pytest.mark.parametrize("checks, said", [
    ([{"copies": 0.0, "moved": 0.1, "ranks_agree": False}], "gradients were not all-reduced"),
    ([{"copies": 0.0, "moved": 0.0, "ranks_agree": True}], "did not move"),
    ([{"copies": 0.05, "moved": 0.1, "ranks_agree": True}], "ended with different weights"),
])
def test_skipped_work_fails_however_fast(checks, said):
    from ddp_lab.grade.exercises.nb12_speed import verdict
    found = verdict([2.0] * 7, checks)
    assert len(found) == 1 and said in found[0] and "skips work earns nothing" in found[0]


def test_an_answer_that_hands_the_work_to_torch_is_refused():
    from ddp_lab.grade.exercises._watch import torch_own_inside
    model = torch.nn.Linear(2, 2)
    wrapper = torch.nn.Module()
    wrapper.inner = torch.nn.Sequential(torch.nn.SyncBatchNorm(2))
    assert torch_own_inside(wrapper) == "torch.nn.SyncBatchNorm"
    assert torch_own_inside(nb12_zero.ShardedAdam.__new__(nb12_zero.ShardedAdam)) is None
    assert torch_own_inside(model) is None
