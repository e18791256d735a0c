"""The comparisons behind rank-state, same-noise in the training loop and the per-rank --resume, on
hand-made records (no launch): what is a finding, what is not, and what a clean report says."""
from ddp_lab.verify.resume import compare
from ddp_lab.verify.state import noise_checked, rank_state, same_loop_noise, update_under_rank


def step(n, **fields):
    return {"kind": "step", "step": n, "at": "train.py:30", **fields}


def held(h, name="ema", cls="Sequential"):
    return {name: {"class": cls, "hash": h, "tensors": 4}}


def test_state_that_differs_on_one_rank_is_found_and_equal_state_is_not():
    records = {r: [step(1, state=held("a")), step(2, state=held("a" if r == 0 else "b"))] for r in (0, 1)}
    (f,) = rank_state(records, 2)
    assert (f.category, f.rank, f.step) == ("rank-state", 1, 2)
    assert "`ema` (Sequential)" in f.message and "equal on every rank after step 1, then not" in f.evidence
    same = {r: [step(1, state=held("a")), step(2, state=held("b"))] for r in (0, 1)}
    assert rank_state(same, 2) == []
    only_rank_0 = {0: [step(1, state=held("a"))], 1: [step(1, state={})]}  # not held by every rank
    assert rank_state(only_rank_0, 2) == []


def test_the_update_under_a_rank_condition_is_the_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nema = {}\nrank = 0\nfor i in range(3):\n    if rank == 0:\n"
                      "        print(i)\n        ema['w'] = i\n")
    assert update_under_rank(str(script), "ema") == (5, "if rank == 0:", 7)
    assert update_under_rank(str(script), "teacher") is None


def rng(t="t", p="p"):
    return {"torch": t, "random": p}


def loop(after, before, passes=()):
    """Two ranks: rng_after of step 1 and rng_before of step 2 per rank, passes begun after step k."""
    return {r: [step(1, rng_after=after[r]), step(2, rng_before=before[r])]
            + [{"kind": "pass", "loader": 0, "pass": 1, "step": k} for k in passes] for r in (0, 1)}


def test_the_loop_drawing_from_one_state_on_every_rank_is_same_noise():
    (f,) = same_loop_noise(loop([rng(), rng()], [rng("u"), rng("u")]), 2)
    assert (f.category, f.step) == ("same-noise", 2) and "every rank drew the same noise" in f.message
    assert "seed with seed + rank" in f.fix and "torch's global generator" in f.message


def test_a_seed_per_rank_no_draw_or_a_new_loader_pass_is_no_finding():
    assert same_loop_noise(loop([rng("a"), rng("b")], [rng("c"), rng("d")]), 2) == []  # states differ
    assert same_loop_noise(loop([rng(), rng()], [rng(), rng()]), 2) == []  # nothing drawn
    assert same_loop_noise(loop([rng(), rng()], [rng("u"), rng("u")], passes=[1]), 2) == []  # iterator's seed


def test_the_clean_report_says_whether_draws_were_observed():
    drew = noise_checked(loop([rng("a"), rng("b")], [rng("c"), rng("d")]))
    assert drew == ["same-noise: observed, the training loop (between steps) drew from the global generators in "
                    "1 of 1 interval without a new loader pass, their states compared across ranks"]
    (quiet,) = noise_checked(loop([rng(), rng()], [rng(), rng()]))
    assert quiet.startswith("same-noise: not observed: the training loop (between steps) drew nothing")
    assert noise_checked({0: [step(1)], 1: [step(1)]}) == []  # nothing watched: no line


def run(params, rng_state="s", batch="b"):
    return {"params": {"w": params}, "pre_params": "p", "pre_opt": "o", "lr": [0.1], "batch": batch,
            "rng_before": {"torch": rng_state}, "at": "train.py:40"}


def test_a_resume_is_compared_on_every_rank_and_names_the_rank_not_restored():
    a = {n: run(f"after {n}") for n in (1, 2, 3)}
    c0 = [run("wrong 2"), run("wrong 3")]  # the averaged gradient differs on every rank
    c1 = [run("wrong 2", rng_state="rank 0's"), run("wrong 3")]
    (f,) = compare(a, c0, 2, {1: (a, c1)})
    assert (f.rank, f.step) == (1, 2) and "what was not restored is rank 1's" in f.message
    assert "on rank 1: the random state before the step (torch's global generator)" in f.evidence
    assert "restores rank 0's stream only" in f.fix
    # a generator that starts every launch elsewhere (never seeded) is not blamed
    (g,) = compare(a, c0, 2, {1: (a, c1)}, seeded={0: set(), 1: set()})
    assert "random state" not in g.evidence and "something else" in g.evidence
    # rank 1 alone drew another batch: found on rank 1, though rank 0's own state came back exactly
    (h,) = compare(a, c0, 2, {1: (a, [run("wrong 2", batch="other"), run("wrong 3")])})
    assert h.rank == 1 and "on rank 1: the batch" in h.evidence and "on rank 0" not in h.evidence
    assert compare(a, [a[2], a[3]], 2, {1: (a, [a[2], a[3]])}) == []
