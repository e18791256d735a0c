"""The alpha-beta model: formulas agree with the simulated schedules, and the fit recovers them."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddp_lab.lessons import costmodel, ring

ALPHA, BETA = 1.5e-3, 1e-9


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_ring_and_naive_formulas_equal_the_simulated_schedules(n):
    numel = 4096 * n  # divisible: no chunk rounding
    S = numel * 4
    for name in ("ring", "naive"):
        sim = ring.simulate([np.zeros(numel, dtype=np.float32)] * n, name)
        assert costmodel.from_steps(sim, ALPHA, BETA) == pytest.approx(
            float(costmodel.MODELS[name](S, n, ALPHA, BETA)), rel=1e-12)


def test_fit_recovers_alpha_and_beta_from_exact_times():
    sizes = 4 ** np.arange(5, 13)
    for n in (2, 4, 8):
        t = costmodel.ring(sizes, n, ALPHA, BETA)
        a, b = costmodel.fit(sizes, t, n)
        assert a == pytest.approx(ALPHA, rel=1e-6) and b == pytest.approx(BETA, rel=1e-6)
        assert costmodel.relative_error(costmodel.ring(sizes, n, a, b), t).max() < 1e-6


def test_fit_with_noise_beats_one_term_models():
    rng = np.random.default_rng(0)
    sizes = 4 ** np.arange(6, 13)
    t = costmodel.ring(sizes, 2, ALPHA, BETA) * rng.uniform(0.9, 1.1, sizes.size)
    a, b = costmodel.fit(sizes, t, 2)
    err2 = costmodel.relative_error(costmodel.ring(sizes, 2, a, b), t).mean()
    only_a = costmodel.fit_one_term(sizes, t, 2, "alpha")
    only_b = costmodel.fit_one_term(sizes, t, 2, "beta")
    assert err2 < costmodel.relative_error(costmodel.ring(sizes, 2, only_a, 0), t).mean()
    assert err2 < costmodel.relative_error(costmodel.ring(sizes, 2, 0, only_b), t).mean()


def test_busbw_is_flat_in_n_for_the_ring_and_algbw_is_not():
    S = 2 ** 26
    t = [costmodel.ring(S, n, 0.0, BETA) for n in (2, 4, 8, 64)]
    bus = [costmodel.busbw(S, ti, n) for ti, n in zip(t, (2, 4, 8, 64))]
    alg = [costmodel.algbw(S, ti) for ti in t]
    assert np.allclose(bus, 1 / BETA)
    assert alg[0] > alg[1] > alg[2] > alg[3]
    assert alg[-1] == pytest.approx(0.5 / BETA * 64 / 63)


def test_tree_wins_small_messages_on_many_ranks_ring_wins_big_ones():
    n = 64
    assert costmodel.tree(1024, n, ALPHA, BETA) < costmodel.ring(1024, n, ALPHA, BETA)
    assert costmodel.ring(2 ** 30, n, ALPHA, BETA) < costmodel.tree(2 ** 30, n, ALPHA, BETA)
    cross = costmodel.crossover_bytes(n, ALPHA, BETA)
    assert costmodel.ring(cross, n, ALPHA, BETA) < costmodel.tree(cross, n, ALPHA, BETA)
    assert costmodel.ring(cross / 2, n, ALPHA, BETA) >= costmodel.tree(cross / 2, n, ALPHA, BETA)
    # Naive is never better than the ring for n > 2.
    assert costmodel.naive(2 ** 20, 8, ALPHA, BETA) > costmodel.ring(2 ** 20, 8, ALPHA, BETA)


def test_fit_rejects_too_few_points():
    with pytest.raises(ValueError, match="at least two"):
        costmodel.fit([1024], [1e-3], 2)


def test_pipelined_tree_is_the_plain_tree_with_one_chunk_and_never_slower():
    sizes = 4.0 ** np.arange(3, 15)
    for n in (2, 8, 64, 512):
        assert np.allclose(costmodel.tree_pipelined(sizes, n, ALPHA, BETA, chunks=1), costmodel.tree(sizes, n, ALPHA, BETA))
        best = costmodel.tree_pipelined(sizes, n, ALPHA, BETA)
        assert np.all(best <= costmodel.tree(sizes, n, ALPHA, BETA) * (1 + 1e-12))
        for k in (2, 7, 64):  # the chosen chunk count is at least as good as these
            assert np.all(best <= costmodel.tree_pipelined(sizes, n, ALPHA, BETA, chunks=k) * 1.02)


def test_pipelined_tree_bandwidth_term_does_not_grow_with_log_n():
    S = 2.0 ** 34  # 16 GiB: bandwidth-bound
    for n in (8, 64, 512):
        assert costmodel.tree_pipelined(S, n, ALPHA, BETA) < 1.1 * 2 * S * BETA
        assert costmodel.tree(S, n, ALPHA, BETA) >= 2 * math.ceil(math.log2(n)) * S * BETA


def test_pipelining_moves_the_ring_tree_crossover_up_on_many_ranks():
    cross = {(n, a): costmodel.crossover_bytes(n, ALPHA, BETA, a=a) for n in (8, 64, 512)
             for a in ("tree", "tree (pipelined)")}
    assert all(cross[n, "tree (pipelined)"] >= cross[n, "tree"] for n in (8, 64, 512))
    assert cross[64, "tree (pipelined)"] > 4 * cross[64, "tree"]
    assert cross[512, "tree (pipelined)"] > 64 * cross[512, "tree"]
    for n in (8, 64, 512):  # at the crossover the ring really is cheaper, and just below it is not
        c = cross[n, "tree (pipelined)"]
        assert costmodel.ring(c, n, ALPHA, BETA) < costmodel.tree_pipelined(c, n, ALPHA, BETA)
        assert costmodel.ring(c / 2, n, ALPHA, BETA) >= costmodel.tree_pipelined(c / 2, n, ALPHA, BETA)


def test_fit_record_round_trip(tmp_path):
    path = tmp_path / "records" / "fit.json"
    assert costmodel.load_fit(path) is None
    costmodel.save_fit(path, 2e-4, 1e-9, 2, [4096, 2 ** 24], "gloo")
    rec = costmodel.load_fit(path)
    assert (rec["alpha_s"], rec["beta_s_per_byte"], rec["ranks"], rec["sizes_bytes"]) == (2e-4, 1e-9, 2, [4096, 2 ** 24])
    assert rec["torch"] and rec["machine"] and rec["date_utc"]
    path.write_text('{"alpha_s": 1}')
    with pytest.raises(ValueError, match="re-run notebook 03"):
        costmodel.load_fit(path)


NOTEBOOK_03_SAVES = """
import json
from ddp_lab.lessons import costmodel
record = costmodel.save_fit(costmodel.RECORD, 3e-4, 2e-9, 2, [4096], backend="gloo")  # notebook 03's call
print(json.dumps({"record": costmodel.RECORD, "read": costmodel.load_fit(costmodel.RECORD)["alpha_s"]}))
"""
REPO = Path(costmodel.__file__).resolve().parents[2]


def _checkout(tmp_path) -> Path:
    """A checkout's notebooks/ folder holding the tracked record; returns the record."""
    stored = tmp_path / "notebooks" / "records" / "03_alpha_beta.json"
    stored.parent.mkdir(parents=True)
    stored.write_text('{"alpha_s": 0.000128, "beta_s_per_byte": 2.97e-10, "date_utc": "stored"}\n')
    return stored


def _run_notebook_03_save(notebooks: Path, env_extra) -> dict:
    """Notebook 03's save in a fresh kernel's place: its own process, cwd notebooks/."""
    env = {k: v for k, v in os.environ.items() if k != costmodel.STORE_ENV}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", NOTEBOOK_03_SAVES], cwd=notebooks,
                          env={**env, **env_extra}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_learners_run_of_notebook_03_leaves_the_tracked_record_unchanged(tmp_path):
    stored = _checkout(tmp_path)
    before = stored.read_bytes()
    out = _run_notebook_03_save(stored.parents[1], {})
    assert stored.read_bytes() == before
    assert out == {"record": "../runs/03_alpha_beta.json", "read": 3e-4}  # and notebook 09 reads it
    assert json.loads((tmp_path / "runs" / "03_alpha_beta.json").read_text())["alpha_s"] == 3e-4
    assert "runs/" in (REPO / ".gitignore").read_text().split()  # which git ignores


def test_the_workbooks_stored_run_writes_the_tracked_record(tmp_path):
    stored = _checkout(tmp_path)
    out = _run_notebook_03_save(stored.parents[1], {costmodel.STORE_ENV: "1"})
    assert out == {"record": "records/03_alpha_beta.json", "read": 3e-4}
    assert json.loads(stored.read_text())["alpha_s"] == 3e-4
    assert not (tmp_path / "runs").exists()


def test_notebook_09_reads_the_stored_fit_until_a_learner_has_one(tmp_path, monkeypatch):
    stored = _checkout(tmp_path)
    monkeypatch.chdir(stored.parents[1])
    assert costmodel.load_fit(costmodel.LEARNER)["date_utc"] == "stored"  # no run of 03 here yet
    assert costmodel.load_fit("records/missing.json") is None  # only the learner's path falls back
