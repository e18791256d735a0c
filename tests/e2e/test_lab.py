"""JupyterLab as a learner meets it: notebooks open clean, widgets draw and respond, stop is calm.

Every interactive widget is found, not listed: a function in ddp_lab/ that imports ipywidgets
makes a widget, and every notebook cell that calls one is exercised here (notebook 03's
Ring-AllReduce stepper also step by step). Screenshots go to each test's temporary folder.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import processes_with, wait_until, widget_cells, widget_makers  # tests/conftest.py

from .lab_page import NOTEBOOKS, PANEL, ROOT, LabPage, widget_snapshot

RING = "notebooks/03_ring_allreduce.ipynb"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.fixture
def open_notebook(browser, lab, tmp_path):
    pages = []

    def open_(path):
        pages.append(LabPage(browser, lab, path, tmp_path))
        return pages[-1]
    yield open_
    for p in pages:
        errors = p.errors
        p.close()
        assert not errors, "browser console errors:\n" + "\n".join(errors)


def test_widget_makers_are_found():
    assert {"ring_stepper", "calculator"} <= widget_makers()
    assert (RING, next(i for n, i in widget_cells() if n == RING)) in widget_cells()


OPENS = 4  # "Error displaying widget: model not found" was once seen in 1 of 4 opens of notebook 09


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_opens_unmodified(open_notebook, path):
    """Every notebook opens unmodified. One with widgets is then reloaded, before any cell runs, until
    it has opened OPENS times: each time every widget cell shows its one line ("... to use the
    controls"), never "Error displaying widget", and the console stays clean. The stored
    notebooks hold no widget view (`make workbook` stores the line instead), so no open can ask the
    kernel for a widget model it never made: the cause of that message."""
    page = open_notebook(path)
    assert not page.dirty, (f"{path} opens marked as modified: JupyterLab rewrote it on opening "
                            f"(kernelspec {page.js(f'{PANEL}.context.model.metadata.kernelspec')})")
    cells = [i for p, i in widget_cells() if p == path]
    for k in range(OPENS if cells else 0):
        if k:
            page.reload()
        for index in cells:  # JupyterLab draws only the cells near the view: bring each one there
            cell = f"{PANEL}.content.widgets[{index}]"
            page.js(f"({PANEL}.content.activeCellIndex = {index}, {PANEL}.content.scrollToItem"
                    f" && {PANEL}.content.scrollToItem({index}), true)")
            page.wait(f"{cell}.outputArea.node.innerText.includes('to use the controls')", 30,
                      f"open {k + 1}: the widget cell {index} never showed its line")
            text = page.js(f"{cell}.outputArea.node.innerText")
            assert "Error displaying widget" not in text and "model not found" not in text, (k, index, text[:200])
        assert not page.errors, f"open {k + 1} of {path}: " + "\n".join(page.errors)


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "untrusted"])
def test_stepper_says_what_it_does_before_the_notebook_runs(open_notebook, lab, trusted):
    """Before a run the stepper has no kernel behind it: its cell shows one line saying what it
    does once run, and the strip in the next cell shows every step. No control is drawn (a stored
    widget would move without redrawing); the same in a notebook opened trusted (`make lab`) and
    untrusted (a plain `jupyter lab`, a download)."""
    lab.trust(ROOT / RING, trusted)
    try:
        page = open_notebook(RING)
    finally:
        lab.trust(ROOT / RING, True)
    index = page.cell_index(r"ring_stepper\(")
    assert not [o for o in page.cell_outputs(index) if WIDGET_VIEW in o.get("data", {})], \
        "the stored output is a widget: it would draw only where trusted, and never redraw"
    cell = page.cell(index)
    cell.scroll_into_view_if_needed()
    page.output_area(index).wait_for(timeout=30_000)
    page.shot(cell, "stepper_before_running")
    text = page.output_text(index)
    assert "to use the controls" in text and "VBox(children=" not in text, text[:200]
    assert cell.locator(".jupyter-widgets").count() == 0, "a control is drawn with no kernel behind it"
    strip = page.cell(index + 1)
    strip.scroll_into_view_if_needed()
    strip.locator(".jp-Cell-outputArea img").first.wait_for(timeout=30_000)
    assert strip.locator(".jp-Cell-outputArea img").count() == 1, "no strip of the steps beside it"


def test_ring_stepper_draws_every_step(open_notebook):
    page = open_notebook(RING)
    index = page.cell_index(r"ring_stepper\(")
    # the setup cell (imports), then the stepper: nbval runs the whole notebook, this test the widget
    page.run_cells(sorted({page.first_code_cell(), index}))
    cell = page.cell(index)
    cell.scroll_into_view_if_needed()
    step = cell.locator(".widget-slider", has=page.page.locator(".widget-label", has_text="step"))
    readout = step.locator(".widget-readout")
    # The kernel is idle before the browser has drawn the widget's view and its first picture:
    # wait for both, or a cold JupyterLab is caught half-way.
    step.locator(".noUi-handle").wait_for(timeout=60_000)
    page.page.wait_for_function(
        "node => node.querySelectorAll('.jp-OutputArea-output img').length === 1",
        arg=cell.element_handle(), timeout=60_000)
    last = int(step.evaluate("n => n.querySelector('.noUi-handle').getAttribute('aria-valuemax')")
               .split(".")[0])
    assert last == 6, f"a 4-rank ring all-reduce has 2(N-1) = 6 steps, the slider goes to {last}"
    def picture():
        return cell.evaluate("n => [...n.querySelectorAll('.jp-OutputArea-output img')].map(i => i.src)")

    assert len(picture()) == 1
    seen = picture()
    page.shot(cell, "step_0")
    handle = step.locator(".noUi-handle")
    for k in range(1, last + 1):
        handle.focus()
        handle.press("ArrowRight")
        # one picture, and one not seen at any earlier step (clear_output(wait=True) swaps it whole)
        page.page.wait_for_function(
            "([node, seen]) => { const imgs = node.querySelectorAll('.jp-OutputArea-output img');"
            " return imgs.length === 1 && !seen.includes(imgs[0].src); }",
            arg=[cell.element_handle(), seen], timeout=60_000)
        assert readout.inner_text().strip() == str(k)
        seen += picture()
        page.shot(cell, f"step_{k}")
    assert len(set(seen)) == last + 1, "two steps drew the same picture"
    exercise_controls(page, index, skip_labels={"step"})


@pytest.mark.parametrize("path,index", [c for c in widget_cells() if c[0] != RING])
def test_widget_responds_to_each_control(open_notebook, path, index):
    page = open_notebook(path)
    page.run_cells(sorted({page.first_code_cell(), index}))   # the setup cell (imports), then the widget's
    exercise_controls(page, index)


def exercise_controls(page, index, skip_labels=()):
    """Move every slider to an end and pick another option in every dropdown; each must change
    what the widget shows."""
    cell = page.cell(index)
    cell.scroll_into_view_if_needed()
    cell.locator(".jupyter-widgets").first.wait_for(timeout=60_000)  # drawn after the kernel is idle
    assert cell.locator(".jupyter-widgets").count() > 0, "the cell shows no live widget"
    controls = cell.locator(".widget-slider, .widget-dropdown")
    assert controls.count() > 0, "a widget without sliders or dropdowns"
    for i in range(controls.count()):
        control = controls.nth(i)
        label = control.locator(".widget-label").inner_text().strip()
        if label in skip_labels:
            continue
        before = widget_snapshot(cell)
        handle = control.locator(".noUi-handle")
        if handle.count():  # to the far end: one notch may round to the same result
            at_max = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
            handle.focus()
            handle.press("Home" if at_max else "End")
            if not shows_a_change(page, cell, before, 5_000):
                # After the controls before it moved, one end can give the same result (overlap
                # matters little once communication dwarfs backward): the other end must not. A
                # redraw slower than 5 s is no failure: the check below still compares with `before`.
                handle.focus()
                handle.press("End" if at_max else "Home")
                assert shows_a_change(page, cell, before, 60_000), f"moving {label!r} changed nothing"
        else:
            select = control.locator("select")
            options = select.locator("option").all_inner_texts()
            current = select.evaluate("s => s.selectedIndex")
            select.select_option(index=(current + 1) % len(options))
            assert shows_a_change(page, cell, before, 60_000), f"choosing another {label!r} changed nothing"
        page.shot(cell, f"control_{re.sub(r'[^a-z0-9]+', '_', label.lower()) or i}")


def shows_a_change(page, cell, before, timeout_ms) -> bool:
    """Whether what the widget shows differs from `before` within the time given."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    try:
        page.page.wait_for_function(
            """([node, before]) => {
                const out = [...node.querySelectorAll('.jp-OutputArea-output img')].map(i => i.src);
                for (const el of node.querySelectorAll('.widget-output, .widget-html-content')) out.push(el.innerText);
                return out.join('\\n') !== before; }""",
            arg=[cell.element_handle(), before], timeout=timeout_ms)
        return True
    except PlaywrightTimeout:
        return False


def test_stop_button_shows_one_short_message(open_notebook, tmp_path):
    page = open_notebook("notebooks/00_first_launch.ipynb")
    marker = tmp_path / "stop-marker"
    n = len(page.sources())
    source = ("from ddp_lab.engine import launch\n"
              f"launch.torchrun({str(ROOT / 'tests/programs/sleeper.py')!r}, nproc=2, args=[{str(marker)!r}])")
    cell = json.dumps({"cell_type": "code", "source": source})
    page.js(f"window.jupyterapp.shell.currentWidget.content.model.sharedModel.insertCell({n}, {cell})")
    page.command("notebook:run-cell", active_cell=n)
    assert wait_until(lambda: (tmp_path / "stop-marker.ready").exists(), timeout=180), "the ranks never started"
    page.button("notebook:interrupt-kernel").click()   # the stop button
    page.wait("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle' && "
              f"window.jupyterapp.shell.currentWidget.content.widgets[{n}].model.executionCount !== null",
              120, "the interrupted cell never finished")
    cell = page.cell(n)
    cell.scroll_into_view_if_needed()
    page.shot(cell, "after_stop")
    text = page.output_text(n)
    assert re.search(r"interrupted|stopped", text), f"the stop button left no message:\n{text}"
    assert wait_until(lambda: not processes_with(str(marker)), timeout=30), "ranks left running"
    for noise in ("Traceback", "launch.py", "queue.py", "threading.py"):
        assert noise not in text, f"the stop button shows a traceback ({noise!r}):\n{text}"
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("[rank")]
    assert len(lines) <= 4, f"the stop button printed {len(lines)} lines:\n{text}"


def test_px_error_shows_once_per_rank_and_stop_keeps_the_last_lines(open_notebook, tmp_path):
    """Live ranks (notebook 01b's %%px): a rank's error shows once, short; a stop loses no line."""
    page = open_notebook("notebooks/00_first_launch.ipynb")
    busy = tmp_path / "busy"
    cells = ["from ddp_lab.engine import interactive\nranks = interactive.start(nproc=2)",
             '%%px\nprint("before", rank)\nx = 1.0 if rank == 0 else 1 / 0',
             f'%%px\nimport time\nprint("before the stop", rank)\n'
             f'open({str(busy)!r} + str(rank), "w").close()\ntime.sleep(600)',
             "ranks.stop()"]
    n = len(page.sources())
    for i, source in enumerate(cells):
        cell = json.dumps({"cell_type": "code", "source": source})
        page.js(f"window.jupyterapp.shell.currentWidget.content.model.sharedModel.insertCell({n + i}, {cell})")

    def run(index, timeout=240, then=None):
        page.command("notebook:run-cell", active_cell=index)
        if then:
            then()
        page.wait("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle' && "
                  f"window.jupyterapp.shell.currentWidget.content.widgets[{index}].model.executionCount !== null",
                  timeout, f"cell {index} never finished")
        page.cell(index).scroll_into_view_if_needed()
        return shown(page.cell_outputs(index))  # the cell's model: complete once the kernel is idle

    assert "2 ranks up" in run(n), page.cell_outputs(n)
    text = run(n + 1)
    page.shot(page.cell(n + 1), "px_error")
    assert "before 0" in text and "before 1" in text, text
    assert text.count("Traceback") == 1, f"rank 1's traceback is not shown exactly once:\n{text}"
    assert text.count("ZeroDivisionError: division by zero") == 1, text
    assert text.rstrip().endswith("RanksError: the cell failed on rank 1 (traceback above)"), text

    def stop_when_busy():
        assert wait_until(lambda: all(Path(f"{busy}{r}").exists() for r in (0, 1)), timeout=120)
        page.button("notebook:interrupt-kernel").click()   # the stop button
    text = run(n + 2, then=stop_when_busy)
    page.shot(page.cell(n + 2), "px_stopped")
    assert "before the stop 0" in text and "before the stop 1" in text, f"a line was lost:\n{text}"
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert "RanksInterrupted: the ranks stopped" in text and text.count("the ranks stopped") == 1, text
    run(n + 3)


def shown(outputs: list) -> str:
    """The text a cell's outputs show (streams, text of displays, tracebacks), without colours."""
    parts = []
    for o in outputs:
        if o["output_type"] == "stream":
            parts.append("".join(o["text"]))
        elif o["output_type"] == "error":
            parts.append("\n".join(o["traceback"]))
        else:
            parts.append("".join(o.get("data", {}).get("text/plain", "")))
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(parts))


def test_stepper_end_key_reaches_the_last_step_after_n_changes(open_notebook):
    """After N changes, the step slider's End key goes to the new last step, 2(N-1), not to the old
    one (the browser's slider keeps the range it was made with for Home and End); and moving the
    controls adds nothing to JupyterLab's Log Console: every picture is drawn inside the widget."""
    page = open_notebook(RING)
    index = page.cell_index(r"ring_stepper\(")
    page.run_cells(sorted({page.first_code_cell(), index}))
    cell = page.cell(index)
    cell.scroll_into_view_if_needed()

    def log_entries() -> str:  # the status bar's Log Console item: its number of entries
        return page.js("(document.querySelector('.jp-LogConsoleStatusItem') || {innerText: '0'}).innerText.trim()")

    def press(label, key, expected: int):
        """Press a key on a slider; its readout must come to `expected`."""
        slider = cell.locator(".widget-slider", has=page.page.locator(".widget-label", has_text=label))
        handle = slider.locator(".noUi-handle")
        handle.wait_for(timeout=60_000)
        handle.focus()
        handle.press(key)
        try:
            page.page.wait_for_function("([n, v]) => n.innerText.trim() === v",
                                        arg=[slider.locator(".widget-readout").element_handle(), str(expected)],
                                        timeout=30_000)
        except Exception:
            page.shot(cell, f"{label}_{key}")
            shown = dict(zip(cell.locator(".widget-slider .widget-label").all_inner_texts(),
                             cell.locator(".widget-slider .widget-readout").all_inner_texts()))
            raise AssertionError(f"{key} on {label!r} reached {shown}, not {label} = {expected}") from None

    def ready(last: int):  # the step slider on screen goes to `last`: the kernel's answer to N drawn
        page.page.wait_for_function(
            "([node, v]) => [...node.querySelectorAll('.widget-slider')].some(s =>"
            " s.innerText.includes('step') && s.querySelector('.noUi-handle') &&"
            " parseInt(s.querySelector('.noUi-handle').getAttribute('aria-valuemax')) === v)",
            arg=[cell.element_handle(), last], timeout=60_000)

    # every output message the kernel sends from now on, with the kind of message it answers
    page.js(f"(window.__outputs = [], {PANEL}.sessionContext.session.kernel.anyMessage.connect((k, a) => {{"
            "if (a.direction === 'recv' && ['display_data', 'update_display_data', 'stream', 'error', 'clear_output']"
            ".includes(a.msg.header.msg_type)) window.__outputs.push([a.msg.header.msg_type,"
            " a.msg.parent_header.msg_type, JSON.stringify(a.msg.content).slice(0, 150)]); }), true)")
    before = log_entries()
    press("step", "End", 6)          # N=4: 2(N-1) = 6 steps
    press("N ranks", "End", 8)       # the ranks slider to its end: N=8
    ready(14)
    press("step", "End", 14)         # the new last step, not the old 6
    press("N ranks", "Home", 2)      # fewer steps: End again goes to the last one
    ready(2)
    press("step", "Home", 0)
    press("step", "End", 2)
    page.wait(f"{PANEL}.sessionContext.session.kernel.status === 'idle'", 60, "the kernel stayed busy")
    page.page.wait_for_timeout(1000)  # a stray message would arrive after the last redraw
    page.shot(cell, "stepper_end_after_n_changes")
    stray = [m for m in page.js("window.__outputs") if m[1] == "comm_msg"]  # sent from a control's callback
    assert log_entries() == before and not stray, (
        f"the stepper wrote to the Log Console ({before or 0} entries before, {log_entries() or 0} after): {stray}")
