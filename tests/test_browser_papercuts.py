"""What a learner meets in the browser: calculators that start where the call says, widgets that
say how to use them where no kernel draws them, grade feedback shown once, counted words in the
right number, figures readable at 100 % zoom, and `make lab`'s settings and PATH."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from ddp_lab.lessons import beyond, plural  # noqa: E402
from ddp_lab.lessons.profiling import model as pm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUN_IT = "run the notebook from the top (Run menu: Run All Cells) to use the controls"
W = pytest.importorskip("ipywidgets")


def _on_grid(slider, value):
    """The browser snaps a slider to min + k*step (of the exponent, for a log slider)."""
    x = math.log(value, slider.base) if isinstance(slider, W.FloatLogSlider) else value
    k = (x - slider.min) / slider.step
    return abs(k - round(k)) < 1e-6 and slider.min <= x <= slider.max


# ---- 09's memory calculator ---------------------------------------------------------------------

@pytest.mark.parametrize("params_b, world", [(7, 8), (1, 8), (70, 64), (6.5, 1), (2000, 2048)])
def test_memory_calculator_starts_at_the_calls_values_and_prints_tables_row(capsys, params_b, world):
    box = beyond.calculator(params_b=params_b, world=world)
    form = box.children[0]
    assert form.kwargs["params_b"] == params_b and form.kwargs["world"] == world
    assert form.kwargs["device_gb"] == 80 and form.kwargs["recipe"] == beyond.DEFAULT
    for control in form.children[:-1]:  # what the browser shows: the same values, not a snapped neighbour
        if isinstance(control, (W.FloatSlider, W.FloatLogSlider)):
            assert _on_grid(control, control.value), control
        elif isinstance(control, W.SelectionSlider):
            assert control.value in [v for _, v in control.options], control  # a stop, not between two
    shown = capsys.readouterr().out  # the first report, printed as the form is built
    row = beyond.table([params_b * 1e9], world=world).splitlines()[-1]   # the function the table uses
    assert row in shown.splitlines(), (row, shown)


def test_memory_calculator_7b_ddp_is_the_tables_figure(capsys):
    beyond.calculator(params_b=7, world=8)
    shown = capsys.readouterr().out
    ddp = beyond.per_device(7e9, 8, "ddp", beyond.RECIPES[beyond.DEFAULT])["total"]
    assert f"{ddp / 1e9:.1f}" == "112.0"
    row = next(line for line in shown.splitlines() if line.strip().startswith("7B |"))
    assert row.split("|")[1].strip() == "112.0", row


# ---- 08's what-if calculator --------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(params=25.6e6, n=8, compute_ms=200.0, overlap=0.7, bucket_mb=25.0),
    dict(params=7e9, n=128, compute_ms=203.0, overlap=0.33, bucket_mb=3.0, scaling="strong"),
    dict(params=1.3e5, n=1, compute_ms=2.5, overlap=0.0, bucket_mb=1000.0, grad_bytes=2),
])
def test_what_if_calculator_starts_at_the_calls_values(kw):
    box = pm.calculator(**kw)
    controls = {c.description: c for c in box.children if getattr(c, "description", "")}
    by_arg = {"params": "params", "n": "GPUs", "compute_ms": "1-GPU ms", "overlap": "overlap",
              "bucket_mb": "bucket MB", "scaling": "batch", "grad_bytes": "gradients"}
    for arg, value in kw.items():
        control = controls[by_arg[arg]]
        assert control.value == value, (arg, control.value, value)
        if isinstance(control, (W.FloatSlider, W.FloatLogSlider)):
            assert _on_grid(control, value), (arg, control.min, control.step, value)
    args = {k: v for k, v in kw.items()}
    assert box.children[-1].value == pm.calculator_text(**args)


def test_calculators_name_bad_inputs():
    with pytest.raises(ValueError, match="positive parameters"):
        beyond.calculator(params_b=7, world=0)
    with pytest.raises(ValueError, match=r"overlap is in \[0, 1\]"):
        pm.calculator(overlap=70)
    with pytest.raises(ValueError, match="link one of"):
        pm.calculator(link="carrier pigeon")


def test_calculators_say_how_to_use_them_where_no_kernel_draws_them():
    for box in (beyond.calculator(params_b=7, world=8), pm.calculator()):
        bundle = box._repr_mimebundle_()
        assert "application/vnd.jupyter.widget-view+json" in bundle
        assert RUN_IT in bundle["text/plain"] and RUN_IT in bundle["text/html"], bundle
        assert "\n" not in bundle["text/plain"]  # one line


# ---- grade.check: shown once, numbers as given --------------------------------------------------

@pytest.fixture
def grades_file(tmp_path, monkeypatch):
    from ddp_lab.grade import store
    monkeypatch.setenv(store.GRADES_ENV, str(tmp_path / "grades.json"))


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell
    ip = InteractiveShell.instance()
    yield ip
    InteractiveShell.clear_instance()


def test_a_cell_ending_in_grade_check_shows_the_verdict_once(grades_file, shell, capsys):
    shell.run_cell("from ddp_lab import grade\ndef ring_bytes(numel, n):\n    ...\n", store_history=True)
    capsys.readouterr()
    shell.run_cell('grade.check("03.6", ring_bytes)', store_history=True)
    out = capsys.readouterr().out
    assert out.count("03.6 Bytes per rank, exactly: not attempted yet") == 1, out
    shell.run_cell('r = grade.check("03.6", ring_bytes)', store_history=True)
    capsys.readouterr()
    shell.run_cell("r", store_history=True)  # asked for again in a later cell: shown
    assert capsys.readouterr().out.count("not attempted yet") == 1


def test_grade_feedback_echoes_ints_as_ints(grades_file, capsys):
    from ddp_lab import grade
    result = grade.check("03.6", lambda numel, n: [66] * n)
    assert result.passed is False
    text = str(result)
    assert "you said [66, 66, 66, 66] bytes" in text and "66.0" not in text, text


def test_grade_feedback_keeps_floats_the_learner_gave(grades_file, capsys):
    from ddp_lab import grade
    text = str(grade.check("03.6", lambda numel, n: [66.0] * n))
    assert "you said [66.0, 66.0, 66.0, 66.0] bytes" in text, text


# ---- plurals ------------------------------------------------------------------------------------

def test_plural_helper():
    assert [plural(k, "GPU") for k in (0, 1, 2)] == ["0 GPUs", "1 GPU", "2 GPUs"]
    assert plural(1, "process", "processes") == "1 process" and plural(3, "process", "processes") == "3 processes"


def test_messages_count_in_the_right_number():
    from ddp_lab.grade.exercises import nb02_exact, nb10_batch
    from ddp_lab.lessons.troubleshooting import ReplicaReport
    one = pm.calculator_text(params=1e5, n=1)
    assert "<pre>1 GPU," in one and "in 1 bucket," in one, one
    many = pm.calculator_text(params=25.6e6, n=8, bucket_mb=25)
    assert "<pre>8 GPUs," in many and " buckets," in many and "(s)" not in many
    assert "1 device: GB per device" in beyond.table(world=1)
    assert "2 devices: GB per device" in beyond.table(world=2)
    assert "(1 buffer not compared" in str(ReplicaReport(True, world_size=2, unchecked=["a"]))
    assert "(2 buffers not compared" in str(ReplicaReport(True, world_size=2, unchecked=["a", "b"]))
    assert "in 1 tensor:" in str(ReplicaReport(False, [1], ["w"], world_size=2))
    [msg] = nb10_batch.judge({0: {"cases": [[64, 2, 64, 16, 1]]}})
    assert "16 x 2 ranks x 1 step = 32 samples" in msg and "16 per rank, 1 step:" in msg, msg
    padded = {"n": 11, "w": 3, "shuffle": False, "epochs": [[[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 0]]] * 2}
    assert nb02_exact._finding(padded).startswith("1 sample read twice:"), nb02_exact._finding(padded)


# ---- 08's figures at 100 % zoom -----------------------------------------------------------------

def _fonts_at_least(fig):
    from matplotlib.text import Text
    from ddp_lab.lessons.figures import LABEL_PT, TEXT_PT, TICK_PT
    fig.canvas.draw()  # every tick label exists now
    small = []
    for ax in fig.axes:
        for t in ax.get_xticklabels() + ax.get_yticklabels():
            if t.get_text() and t.get_fontsize() < TICK_PT:
                small.append(("tick", t.get_text(), t.get_fontsize()))
        for t in (ax.xaxis.label, ax.yaxis.label, ax.title):
            if t.get_text() and t.get_fontsize() < LABEL_PT:
                small.append(("label", t.get_text(), t.get_fontsize()))
    small += [("text", t.get_text(), t.get_fontsize()) for t in fig.findobj(Text)
              if t.get_text() and t.get_fontsize() < TEXT_PT]
    plt.close(fig)
    return small


def test_profiling_figures_are_readable_at_100_percent():
    from ddp_lab.lessons import profiling
    from ddp_lab.lessons.profiling import link, plots as pp
    ns = [1, 2, 4]
    figs = [pp.scaling(ns, {"small": [0.1, 0.06, 0.04]}, {"small": [0.1, 0.05, 0.03]},
                       {"small": [0.1, 0.07, 0.05]}, 2),
            pp.cluster_speedups({"ResNet-50": pm.cluster_table(25.6e6, 8, 200.0, 0.7)}, 8),
            pp.budget_bars([{"label": f"N={n}", "parts": {k: 0.01 for k in profiling.PARTS}, "step_s": 0.06,
                             "samples_s": 500.0} for n in ns])]
    step = profiling.Step(0, 0.0, 300.0, phases={"forward": (0.0, 100.0), "backward": (100.0, 250.0)},
                          backward_ops=[(100.0, 240.0)], comm=[(150.0, 260.0)])
    figs.append(pp.timeline({0: [step], 1: [step]}, count=1, title="two ranks"))
    rows = [{"variant": v, "rate": rate, "measured": m, "predicted": m * 1.1, "comm_share": 0.4}
            for rate in ("100 Mbit/s", "unshaped") for v, m in (("DDP", 0.2), ("bf16 hook", 0.15))]
    figs += [link.plot_rates(rows), link.plot_remedies(rows, "100 Mbit/s", "unshaped")]
    for fig in figs:
        assert _fonts_at_least(fig) == []


# ---- make lab: no news pop-up, the venv's bin/ first on PATH ------------------------------------

@pytest.fixture(scope="module")
def lab_recipe():
    """`make lab`'s commands, printed (make -n) and not run; the install step is taken as done."""
    out = subprocess.run(["make", "-n", "-o", ".venv/.installed", "lab"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _settings_dir(recipe: str) -> Path:
    flag = "--LabApp.app_settings_dir="
    assert flag in recipe, recipe
    return ROOT / recipe.split(flag, 1)[1].split()[0]


def test_make_lab_turns_the_news_and_update_checks_off(lab_recipe):
    from jupyterlab_server.settings_utils import get_settings
    folder = _settings_dir(lab_recipe)
    overrides = json.loads((folder / "overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"] == {"fetchNews": "false",
                                                                        "checkForUpdates": False}
    schemas = Path(sys.prefix) / "share" / "jupyter" / "lab" / "schemas"
    if not schemas.is_dir():
        pytest.skip(f"no JupyterLab schemas in {schemas}")
    settings, _ = get_settings(str(folder), str(schemas), str(folder / "no-user-settings"),
                               schema_name="@jupyterlab/apputils-extension:notification")
    props = settings["schema"]["properties"]  # what JupyterLab loads: the overrides as defaults
    assert props["fetchNews"]["default"] == "false" and props["checkForUpdates"]["default"] is False


def test_make_lab_puts_the_venvs_bin_first_on_path(lab_recipe):
    line = next(ln for ln in lab_recipe.splitlines() if "jupyter lab" in ln)
    assert line.startswith('PATH="'), line
    first = line[len('PATH="'):].split(":", 1)[0]
    assert Path(first) == ROOT / ".venv" / "bin", first
    if (ROOT / ".venv" / "bin" / "torchrun").exists():
        assert os.access(Path(first) / "torchrun", os.X_OK)
