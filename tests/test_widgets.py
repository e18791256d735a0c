"""The ring stepper's caption counts bytes the way the lesson's formula does: per rank."""
from ddp_lab.lessons import widgets


def test_stepper_caption_counts_per_rank_bytes_as_2_n_minus_1_over_n_times_s():
    sim = widgets.simulation(4, "ring")
    last = len(sim.steps)
    # The lesson's claim, computed independently of the caption: each rank sends 2(N-1)/N·S.
    per_rank = 2 * (sim.n - 1) * sim.nbytes // sim.n
    assert widgets.sent_so_far(sim, last) == f"{per_rank} bytes sent per rank so far ({4 * per_rank} by all ranks)"
    assert widgets.sent_so_far(sim, 0).startswith("0 bytes sent per rank")


def test_stepper_caption_says_up_to_when_ranks_send_unequal_amounts():
    sim = widgets.simulation(4, "naive")
    step = 1  # the naive algorithm's first step: one rank sends to rank 0
    sent = {m.src for m in sim.steps[0]}
    assert len(sent) < sim.n
    assert widgets.sent_so_far(sim, step).startswith("up to ")
