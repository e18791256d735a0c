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


# ---- the stepper at N=8, after changes of N and algorithm, and before its cell runs ------------

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402


def _rank_boxes(n):
    """Per rank, the area its drawing takes: its chunk outlines plus room for its name above."""
    sim = widgets.simulation(n, "ring")
    fig, ax = plt.subplots()
    widgets.draw_step(ax, sim, 0)
    outlines = [p for p in ax.patches if not p.get_fill()]
    plt.close(fig)
    per_rank = len(outlines) // n
    boxes = []
    for r in range(n):
        mine = outlines[r * per_rank:(r + 1) * per_rank]
        x0 = min(p.get_x() for p in mine)
        x1 = max(p.get_x() + p.get_width() for p in mine)
        y0 = min(p.get_y() for p in mine)
        y1 = max(p.get_y() + p.get_height() for p in mine)
        boxes.append((x0, y0, x1, y1 + 0.12))  # "rank r" sits just above the box
    return boxes


@pytest.mark.parametrize("n", [2, 4, 6, 8])
def test_rank_boxes_and_names_keep_apart(n):
    gap = 0.1  # a visible gap between neighbours (axes units; the ring's radius is 1)
    boxes = _rank_boxes(n)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            apart = a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]
            assert apart, (n, a, b)


def _controls(box):
    import ipywidgets as W
    row0, row1 = box.children[0].children, box.children[1].children
    algo = next(w for w in row0 if isinstance(w, W.Dropdown))
    ranks = next(w for w in row0 if isinstance(w, W.IntSlider))
    step = next(w for w in row1 if isinstance(w, W.IntSlider))
    end = next(w for w in row1 if isinstance(w, W.Button) and w.description == "End")
    return algo, ranks, step, end


def test_end_goes_to_the_last_step_of_the_current_n():
    pytest.importorskip("ipywidgets")
    box = widgets.ring_stepper(n=4)
    algo, ranks, step, end = _controls(box)
    step.value = 6
    ranks.value = 8
    assert step.max == len(widgets.simulation(8, "ring").steps) == 14
    end.click()
    assert step.value == 14 and box.drawn() == ("step 14/14: all-gather", box.drawn()[1])
    assert box.drawn()[1].startswith("ring, N=8:")
    ranks.value = 3  # fewer steps: the step is brought back within the new range, and drawn
    assert step.max == 4 and step.value == 4 and box.drawn()[0].startswith("step 4/4")
    end.click()
    assert step.value == 4


def test_a_new_number_of_steps_draws_the_step_slider_anew():
    # The browser's slider answers its End key with the range it was drawn with, whatever max is
    # set later: when the number of steps changes, the slider leaves its row and comes back (a new
    # view in the browser) with the new range already set.
    pytest.importorskip("ipywidgets")
    box = widgets.ring_stepper(n=4)
    algo, ranks, step, end = _controls(box)
    row = box.children[1]
    seen = []
    row.observe(lambda change: seen.append((step in change["new"], step.max)), "children")
    step.value = 5
    ranks.value = 8
    assert seen == [(False, 14), (True, 14)]
    seen.clear()
    ranks.value = 8  # no change of N: the slider stays
    step.value = 2
    assert seen == []
    algo.value = "ring_unchunked"  # N=8 unchunked: 7 steps
    ranks.value = 5               # N=5 unchunked: 4 steps
    assert seen == [(False, 7), (True, 7), (False, 4), (True, 4)]
    end.click()
    assert step.value == 4 and box.drawn()[0].startswith("step 4/4")


def test_quick_changes_end_on_the_picture_of_the_last_one():
    pytest.importorskip("ipywidgets")
    box = widgets.ring_stepper(n=4)
    algo, ranks, step, end = _controls(box)
    step.value = 3
    for value in ("naive", "ring", "ring_unchunked"):
        algo.value = value
    ranks.value = 5
    last = len(widgets.simulation(5, "ring_unchunked").steps)
    assert step.max == last
    title, caption = box.drawn()
    assert caption.startswith("ring_unchunked, N=5:") and title.startswith(f"step {min(3, last)}/{last}")


def test_stepper_says_how_to_use_it_where_no_kernel_draws_it():
    pytest.importorskip("ipywidgets")
    box = widgets.ring_stepper(n=4)
    bundle = box._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # a lab with a kernel draws it
    # "run this cell" alone fails in a fresh kernel (NameError: the imports are cells above it)
    line = ("Ring-AllReduce stepper: run the notebook from the top (Run menu: Run All Cells) to use the controls. "
            "The strip below has every step.")
    assert bundle["text/plain"] == line == repr(box)
    assert bundle["text/html"] == f"<p>{line}</p>"


def test_stepper_starts_at_the_calls_values_and_names_bad_ones():
    pytest.importorskip("ipywidgets")
    for n, algorithm in ((2, "naive"), (8, "ring_unchunked"), (12, "ring")):
        algo, ranks, step, _ = _controls(widgets.ring_stepper(n=n, algorithm=algorithm))
        assert (ranks.value, algo.value, step.value) == (n, algorithm, 0)
        assert step.max == len(widgets.simulation(n, algorithm).steps)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        widgets.ring_stepper(n=1)
    with pytest.raises(ValueError, match="ring, ring_unchunked, naive"):
        widgets.ring_stepper(algorithm="tree")


def test_the_stepper_draws_only_inside_its_widget(capfd, monkeypatch):
    # A picture or a warning sent from a control's callback outside the widget's own state lands
    # in JupyterLab's Log Console ("2 new messages"): each move changes the widget's outputs only.
    pytest.importorskip("ipywidgets")
    import warnings

    import IPython.display
    shown = []
    monkeypatch.setattr(IPython.display, "publish_display_data", lambda *a, **k: shown.append(a))
    # a pyplot figure is shown by the notebook's inline backend too, even when closed at once
    figure = plt.figure
    monkeypatch.setattr(plt, "figure", lambda *a, **k: shown.append("pyplot figure") or figure(*a, **k))
    box = widgets.ring_stepper(n=4)
    algo, ranks, step, end = _controls(box)
    out = box.children[2]
    pictures = [out.outputs[0]["data"]["image/png"]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would be printed to the Log Console
        for move in (lambda: ranks.set_trait("value", 8), end.click, lambda: algo.set_trait("value", "naive"),
                     lambda: ranks.set_trait("value", 2), lambda: step.set_trait("value", 0)):
            move()
            assert len(out.outputs) == 1 and out.outputs[0]["output_type"] == "display_data"
            pictures.append(out.outputs[0]["data"]["image/png"])
    assert len(set(pictures)) == len(pictures), "a move left the old picture"
    assert out.outputs[0]["data"]["text/plain"] == "<step 0/2: inputs>" == f"<{box.drawn()[0]}>"
    assert not shown and capfd.readouterr() == ("", ""), "the stepper sent output outside its widget"
