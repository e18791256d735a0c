"""Ring-AllReduce: the simulation is right, costs what theory says, and matches real processes."""
import numpy as np
import pytest
import torch

from ddp_lab.engine import launch
from ddp_lab.lessons import ring

ALGORITHMS = ["ring", "naive", "ring_unchunked"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", range(1, 17))
def test_every_rank_ends_with_the_elementwise_sum(algorithm, n):
    rng = np.random.default_rng(n)
    for shape in [(1,), (n,), (3 * n + 1,), (5, 7)]:  # sizes not divisible by n included
        tensors = [rng.integers(-50, 50, size=shape).astype(np.float64) for _ in range(n)]
        sim = ring.simulate(tensors, algorithm)
        expected = np.sum(tensors, axis=0)
        assert len(sim.outputs) == n
        for out in sim.outputs:
            assert out.shape == expected.shape
            np.testing.assert_array_equal(out, expected)
        # Every chunk of every rank has seen every rank's numbers.
        assert all(h == set(range(n)) for row in sim.holdings[-1] for h in row)


def test_inputs_are_not_modified_and_torch_tensors_work():
    xs = [torch.arange(10.0) * (r + 1) for r in range(3)]
    before = [x.clone() for x in xs]
    sim = ring.simulate(xs)
    assert all(torch.equal(a, b) for a, b in zip(xs, before))
    np.testing.assert_allclose(sim.outputs[2], (torch.arange(10.0) * 6).numpy())


@pytest.mark.parametrize("n", range(2, 17))
@pytest.mark.parametrize("numel", [1000, 1001, 4099])
def test_ring_sends_2_n_minus_1_over_n_of_the_tensor_per_rank(n, numel):
    sim = ring.simulate([np.ones(numel, dtype=np.float32)] * n, "ring")
    S = numel * 4
    ideal = 2 * (n - 1) / n * S
    chunk = -(-numel // n) * 4  # rounding: chunks differ by at most one element
    for sent, received in zip(sim.bytes_sent, sim.bytes_received):
        assert abs(sent - ideal) <= 2 * 4, (sent, ideal, chunk)
        assert abs(received - ideal) <= 2 * 4
    assert sum(sim.bytes_sent) == 2 * (n - 1) * S  # exact in total
    assert len(sim.steps) == 2 * (n - 1)
    assert sim.phases == ["reduce-scatter"] * (n - 1) + ["all-gather"] * (n - 1)
    # Each step every rank sends exactly one chunk to its right neighbour.
    for step in sim.steps:
        assert sorted(m.src for m in step) == list(range(n))
        assert all(m.dst == (m.src + 1) % n for m in step)


@pytest.mark.parametrize("n", range(2, 17))
def test_naive_rank0_carries_n_minus_1_tensors_each_way(n):
    S = 64 * 8
    sim = ring.simulate([np.ones(64)] * n, "naive")
    assert sim.bytes_received[0] == (n - 1) * S
    assert sim.bytes_sent[0] == (n - 1) * S
    assert all(b == S for b in sim.bytes_sent[1:]) and all(b == S for b in sim.bytes_received[1:])
    assert len(sim.steps) == 2 * (n - 1)


@pytest.mark.parametrize("n", range(2, 9))
def test_unchunked_ring_sends_the_whole_tensor_n_minus_1_times(n):
    sim = ring.simulate([np.ones(10)] * n, "ring_unchunked")
    assert sim.bytes_sent == [(n - 1) * 80] * n
    assert len(sim.steps) == n - 1


def test_bad_input_says_what_to_fix():
    with pytest.raises(ValueError, match="same shape"):
        ring.simulate([np.ones(3), np.ones(4)])
    with pytest.raises(ValueError, match="algorithm must be"):
        ring.simulate([np.ones(3)], "butterfly")
    with pytest.raises(ValueError, match="empty"):
        ring.simulate([])


def test_chunk_bounds_cover_the_tensor_evenly():
    for numel in range(0, 40):
        for n in range(1, 9):
            b = ring.chunk_bounds(numel, n)
            sizes = [hi - lo for lo, hi in b]
            assert b[0][0] == 0 and b[-1][1] == numel and sum(sizes) == numel
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.timeout(240)
def test_p2p_ring_on_real_processes_equals_all_reduce_for_2_3_and_4_ranks():
    # One 4-process launch checks the ring on subgroups of 2, 3 and 4 ranks.
    run = launch.torchrun("-m ddp_lab.experiments.nb03_ring", nproc=4, stream=False,
                          args=["--bw-bytes", "65536", "--iters", "2", "--sweep", "4K,64K,1M", "--sweep-iters", "3"])
    checks = run.select(kind="check")
    assert sorted((c["n"], c["rank"]) for c in checks) == [(n, r) for n in (2, 3, 4) for r in range(n)]
    for c in checks:
        assert c["equal"], c                       # integer-valued: bitwise equal
        assert c["max_diff_float64"] < 1e-12, c    # random floats: same up to summation order
        sim = ring.simulate([np.zeros(c["nbytes"] // 4, dtype=np.float32)] * c["n"], "ring")
        assert c["bytes_sent"] == sim.bytes_sent[c["rank"]]  # real bytes = simulated bytes
        assert c["steps"] == 2 * (c["n"] - 1)
    assert {(b["n"], b["impl"]) for b in run.select(kind="bw")} == {
        (n, i) for n in (2, 3, 4) for i in ("all_reduce", "p2p_ring")}
    sweep = run.select(kind="sweep")
    assert sorted(r["bytes"] for r in sweep) == [4096, 65536, 2 ** 20]
    assert all(0 < r["time_min_s"] <= r["time_s"] for r in sweep)   # the fastest round, and the median


def test_static_strip_has_one_panel_per_step_and_the_stepper_builds():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import ipywidgets as W

    from ddp_lab.lessons import widgets

    fig = widgets.ring_strip(n=4)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles[0] == "step 0/6: inputs" and titles[-1] == "step 6/6: all-gather" and len(titles) == 7
    plt.close(fig)
    box = widgets.ring_stepper(n=3)
    sliders = [w for row in box.children[:2] for w in row.children if isinstance(w, W.IntSlider)]
    step = next(s for s in sliders if s.description == "step")
    assert step.max == 4  # 2(N-1) steps for N=3
    algo = next(w for w in box.children[0].children if isinstance(w, W.Dropdown))
    algo.value = "ring_unchunked"
    assert step.max == 2  # N-1 steps


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_collective_bytes_are_the_simulated_ring_phases(n):
    # the formulas notebook 03 prices the hybrid layouts with, against the simulation's own messages
    numel = 64 * n
    sim = ring.simulate([np.ones(numel, dtype=np.float32)] * n, "ring")
    S = numel * 4
    phase = {p: sum(m.nbytes for step, ph in zip(sim.steps, sim.phases) if ph == p for m in step if m.src == 0)
             for p in ("reduce-scatter", "all-gather")}
    assert ring.collective_bytes("reduce_scatter", n, S) == phase["reduce-scatter"]
    assert ring.collective_bytes("all_gather", n, S) == phase["all-gather"]
    assert ring.collective_bytes("all_reduce", n, S) == sim.bytes_sent[0]
    with pytest.raises(ValueError):
        ring.collective_bytes("broadcast", n, S)
