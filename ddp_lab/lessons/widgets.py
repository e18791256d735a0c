"""Pictures of an all-reduce in progress: an interactive stepper and a static strip.

    from ddp_lab.lessons import widgets
    widgets.ring_stepper(n=4)            # slider + play button over the steps (needs a kernel)
    widgets.ring_strip(n=4)              # every step side by side (a plain figure: works on GitHub)

Each rank sits on a circle and holds its tensor cut into chunks. A chunk is drawn
as N thin stripes, one per rank: a stripe is coloured when that rank's numbers have
been added into the chunk. Reduce-scatter fills one chunk per rank with all colours;
all-gather copies the finished chunks round the ring. Arrows are this step's messages.
"""
from __future__ import annotations

import html
import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from ddp_lab.lessons import ring

EMPTY = "#eeeeee"


def rank_colors(n: int) -> list:
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def simulation(n: int = 4, algorithm: str = "ring") -> ring.Simulation:
    """A small example: rank r holds the numbers 1..n times (r + 1); one element per chunk."""
    tensors = [np.arange(1, n + 1, dtype=np.float64) * (r + 1) for r in range(n)]
    return ring.simulate(tensors, algorithm)


def _positions(n: int):
    # Rank 0 at the top, clockwise, like the ring the messages travel.
    angles = [math.pi / 2 - 2 * math.pi * r / n for r in range(n)]
    return [(math.cos(a), math.sin(a)) for a in angles]


def _layout(n: int):
    """Centres, box width and height for n ranks: boxes shrink with N so neighbours never touch."""
    pos = _positions(n)
    gap = 2 * math.sin(math.pi / n)  # distance between neighbouring centres on the unit circle
    w = min(0.95, 0.68 * gap)
    h = min(0.3, 0.42 * w)
    return pos, w, h


def draw_step(ax, sim: ring.Simulation, step: int, small: bool = False) -> None:
    """Draw the state after `step` steps (0 = the inputs) and the messages of that step."""
    n, colors = sim.n, rank_colors(sim.n)
    held = sim.holdings[step]
    nchunks = len(held[0])
    pos, w, h = _layout(n)  # the rank's whole tensor: width w, height h
    ax.set_xlim(-1.6, 1.6)
    ax.set_ylim(-1.45, 1.55)
    ax.set_aspect("equal")
    ax.axis("off")
    for r, (x, y) in enumerate(pos):
        cw = w / nchunks
        for c in range(nchunks):
            x0 = x - w / 2 + c * cw
            for k in range(n):  # one stripe per contributing rank
                colour = colors[k] if k in held[r][c] else EMPTY
                ax.add_patch(Rectangle((x0 + k * cw / n, y - h / 2), cw / n, h, color=colour, lw=0))
            ax.add_patch(Rectangle((x0, y - h / 2), cw, h, fill=False, ec="black", lw=0.8))
        if not small:
            ax.text(x, y + h / 2 + 0.04, f"rank {r}", ha="center", va="bottom", fontsize=9 if n <= 6 else 8,
                    color=colors[r], weight="bold")
    if step > 0:
        for m in sim.steps[step - 1]:
            (x1, y1), (x2, y2) = pos[m.src], pos[m.dst]
            arrow = FancyArrowPatch((x1, y1), (x2, y2), arrowstyle="-|>", mutation_scale=10,
                                    shrinkA=22, shrinkB=22, connectionstyle="arc3,rad=-0.25",
                                    color="black" if m.op == "reduce" else "tab:gray", lw=1.1)
            ax.add_patch(arrow)
            if not small and nchunks > 1:
                mx, my = (x1 + x2) / 2, (y1 + y2) / 2
                ax.text(mx * 1.25, my * 1.25, f"c{m.chunk}", fontsize=8, ha="center", va="center")
        label = f"step {step}/{len(sim.steps)}: {sim.phases[step - 1]}"
    else:
        label = f"step 0/{len(sim.steps)}: inputs"
    ax.set_title(label, fontsize=8 if small else 11)


def sent_so_far(sim: ring.Simulation, step: int) -> str:
    """Bytes sent per rank, the figure 2(N-1)/N·S counts, and the total over all ranks."""
    per_rank = [0] * sim.n
    for s in sim.steps[:step]:
        for m in s:
            per_rank[m.src] += m.nbytes
    most, total = max(per_rank), sum(per_rank)
    each = f"{most} bytes" if min(per_rank) == most else f"up to {most} bytes"
    return f"{each} sent per rank so far ({total} by all ranks)"


def ring_figure(sim: ring.Simulation, step: int, size: float = 4.6):
    """The picture of one step, as a Figure of its own, outside pyplot: a pyplot figure made in a
    control's callback is shown by the notebook's inline backend as well, in JupyterLab's Log Console."""
    fig = Figure(figsize=(size, size))
    ax = fig.add_subplot()
    draw_step(ax, sim, step)
    ax.text(0, -1.4, f"{sim.algorithm}, N={sim.n}: {sent_so_far(sim, step)}\n"
            f"arrows: black adds into the chunk, grey copies it", ha="center", va="top", fontsize=8)
    return fig


def ring_strip(n: int = 4, algorithm: str = "ring", sim: ring.Simulation | None = None, per_row: int = 4):
    """All steps as small multiples, for readers without a running kernel."""
    sim = sim or simulation(n, algorithm)
    panels = len(sim.steps) + 1
    rows = math.ceil(panels / per_row)
    cols = min(panels, per_row)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.7 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < panels:
            draw_step(ax, sim, i, small=True)
        else:
            ax.axis("off")
    fig.suptitle(f"{sim.algorithm} all-reduce, N={sim.n}: each chunk's stripes show whose numbers it holds",
                 fontsize=10)
    fig.tight_layout()
    return fig


# Where no kernel draws a widget (a stored notebook, GitHub): what to do. Not "run this cell": in a
# fresh kernel the cell needs the notebook's imports above it first.
RUN_IT = "run the notebook from the top (Run menu: Run All Cells) to use the controls"


def grid_min(value: float, lo: float, step: float) -> float:
    """The smallest min at or below `lo` (and `value`) whose grid min + k*step passes through
    `value`: a slider snaps its value to that grid, so a grid that misses it shows another number."""
    lo = min(lo, value)
    low = value - math.floor((value - lo) / step + 1e-9) * step
    return lo if abs(low - lo) < 1e-9 * step else low  # on the grid already: keep the round number


def runnable(W, children, name: str, hint: str = ""):
    """A VBox of `children` that says, where no kernel draws it, what it is and how to use it.

    Its output carries the widget view and, beside it, this line as text/plain and text/html: a lab
    with a kernel draws the controls; a stored notebook (ddp_lab.engine.workbook keeps the line and
    drops the view), GitHub or nbviewer show the line."""
    line = f"{name}: {RUN_IT}{hint}."

    class Runnable(W.VBox):
        def __repr__(self):
            return line

        def _repr_mimebundle_(self, **kwargs):
            data = super()._repr_mimebundle_(**kwargs) or {}
            return {**data, "text/plain": line, "text/html": f"<p>{html.escape(line)}</p>"}

    return Runnable(children)


def picture(fig) -> dict:
    """A figure as one output of an Output widget, for its `outputs`: the picture travels in the
    widget's own state, and no display message leaves a control's callback."""
    from IPython.core.pylabtools import print_figure

    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": print_figure(fig, "png", base64=True),
                     "text/plain": f"<{fig.axes[0].get_title()}>"}}


def ring_stepper(n: int = 4, algorithm: str = "ring"):
    """Slider (and play button) over the steps; choose N and the algorithm. Needs ipywidgets.

    Every change draws the picture again from the controls' current values, so a quick series of
    changes ends on the picture of the last one; End goes to the last step of what is shown.
    When the number of steps changes, the step slider is drawn anew: the browser's slider keeps the
    range it was drawn with for its Home and End keys, and End would stop at the old last step."""
    import ipywidgets as W

    algorithms = ["ring", "ring_unchunked", "naive"]
    if algorithm not in algorithms or n < 2:
        raise ValueError(f"ring_stepper(n={n}, algorithm={algorithm!r}): n is at least 2 ranks and the "
                         f"algorithm one of {', '.join(algorithms)}")
    algo = W.Dropdown(options=algorithms, value=algorithm, description="algorithm")
    ranks = W.IntSlider(value=n, min=2, max=max(8, n), description="N ranks")
    step = W.IntSlider(value=0, min=0, max=1, description="step")
    play = W.Play(value=0, min=0, max=1, interval=900, description="play")
    start, end = W.Button(description="Start"), W.Button(description="End")
    W.jslink((play, "value"), (step, "value"))
    row = W.HBox([play, step, start, end])
    out = W.Output(layout=W.Layout(min_height="480px"))
    state = {"key": None, "sim": None, "drawn": None, "busy": False}

    def current() -> ring.Simulation:
        key = (ranks.value, algo.value)
        if state["key"] != key:
            state["key"], state["sim"] = key, simulation(*key)
        return state["sim"]

    def rebuild(_=None):
        last = max(len(current().steps), 1)
        if last != step.max:
            state["busy"] = True  # the moves below would each draw a stale picture
            try:
                if last > step.max:
                    step.max = play.max = last
                else:
                    step.value, play.value = min(step.value, last), min(play.value, last)
                    step.max = play.max = last
            finally:
                state["busy"] = False
            # The browser's slider answers Home and End with the range it was drawn with, whatever
            # max is set later: take the slider out of its row and put it back, to be drawn anew.
            row.children = (play, start, end)
            row.children = (play, step, start, end)
        redraw()

    def redraw(_=None):
        if state["busy"]:
            return
        sim = current()
        at = min(step.value, len(sim.steps))
        fig = ring_figure(sim, at)
        out.outputs = (picture(fig),)  # one state change of the widget, swapping the whole picture
        ax = fig.axes[0]
        state["drawn"] = (ax.get_title(), ax.texts[-1].get_text())  # the step, and the algorithm and N

    algo.observe(rebuild, "value")
    ranks.observe(rebuild, "value")
    step.observe(redraw, "value")
    start.on_click(lambda _: setattr(step, "value", 0))
    end.on_click(lambda _: setattr(step, "value", len(current().steps)))
    rebuild()
    box = runnable(W, [W.HBox([algo, ranks]), row, out], "Ring-AllReduce stepper", ". The strip below has every step")
    box.drawn = lambda: state["drawn"]  # the title and caption of the picture on screen
    return box
