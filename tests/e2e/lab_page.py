"""A notebook open in JupyterLab, seen through Playwright: run cells, read outputs, find widgets.

JupyterLab runs with `expose_app_in_browser`, so `window.jupyterapp` is the application and
its current widget is the notebook panel; the helpers read cell models through it instead of
guessing from pixels, and act through the same commands the menus and buttons call.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
PANEL = "window.jupyterapp.shell.currentWidget"


class LabPage:
    def __init__(self, browser, lab, path: str, shots):
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}")
                     if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.shots, self.n_shots = shots, 0
        self.path = path
        self.page.goto(lab.url(path))
        self.wait(f"{PANEL} && {PANEL}.content && {PANEL}.context.isReady", 120, "the notebook never opened")
        self.id = self.js(f"{PANEL}.id")
        assert self.js(f"{PANEL}.context.path") == path, "another document is in front"
        self.wait(f"{PANEL}.sessionContext.session && {PANEL}.sessionContext.session.kernel"
                  f" && {PANEL}.sessionContext.session.kernel.status === 'idle'", 180, "no idle kernel")

    # --- reading ------------------------------------------------------------------------
    def js(self, expr: str):
        return self.page.evaluate(f"() => {{ return {expr}; }}")

    def wait(self, expr: str, timeout: float, message: str) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if self.page.evaluate(f"() => {{ try {{ return !!({expr}); }} catch (e) {{ return false; }} }}"):
                return
            self.page.wait_for_timeout(250)
        raise AssertionError(f"{message} (after {timeout:g} s)")

    @property
    def dirty(self) -> bool:
        return self.js(f"{PANEL}.context.model.dirty")

    def sources(self) -> list[str]:
        return self.js(f"{PANEL}.content.widgets.map(c => c.model.sharedModel.getSource())")

    def cell_index(self, pattern: str) -> int:
        found = [i for i, s in enumerate(self.sources()) if re.search(pattern, s)]
        assert found, f"no cell matches {pattern!r}"
        return found[0]

    def cell(self, index: int):
        return self.page.locator(f"#{self.id} .jp-Notebook .jp-Cell").nth(index)

    def output_area(self, index: int):
        """The cell's own output area: a widget's Output inside it is a .jp-OutputArea too."""
        return self.cell(index).locator(".jp-Cell-outputArea")

    def output_text(self, index: int) -> str:
        return self.output_area(index).inner_text()

    def cell_outputs(self, index: int) -> list:
        return self.js(f"{PANEL}.content.widgets[{index}].model.outputs.toJSON()")

    # --- acting -------------------------------------------------------------------------
    def command(self, name: str, active_cell: int | None = None) -> None:
        """Start a JupyterLab command (what a menu item or button does); do not wait for it."""
        select = f"{PANEL}.content.activeCellIndex = {active_cell};" if active_cell is not None else ""
        self.page.evaluate(f"() => {{ {select} window.jupyterapp.commands.execute('{name}'); }}")

    def first_code_cell(self) -> int:
        """The index of the notebook's first code cell (its setup: imports, paths)."""
        return next(i for i in range(len(self.sources()))
                    if self.js(f"{PANEL}.content.widgets[{i}].model.type") == "code")

    def run_cells(self, indices, timeout: float = 300) -> None:
        for i in indices:
            self.command("notebook:run-cell", active_cell=i)
            self._wait_for_cells([i], timeout)

    def _wait_for_cells(self, indices, timeout) -> None:
        """Wait until each code cell among `indices` ran; fail at once on an error output."""
        end = time.time() + timeout
        indices = [i for i in indices if self.js(f"{PANEL}.content.widgets[{i}].model.type") == "code"]
        while time.time() < end:
            state = self.js(f"""{json_list(indices)}.map(i => {{
                const m = {PANEL}.content.widgets[i].model;
                const err = m.outputs.toJSON().find(o => o.output_type === 'error');
                // a cell scrolled out of view may have no DOM (JupyterLab renders a window of
                // cells); its model still says whether it ran: executionCount is null until then
                const prompt = {PANEL}.content.widgets[i].node.querySelector('.jp-InputPrompt');
                return [i, m.executionCount, err ? err.ename + ': ' + err.evalue : null,
                        prompt ? prompt.innerText : ''];
            }})""")
            failed = [s for s in state if s[2]]
            assert not failed, f"cell {failed[0][0]} raised {failed[0][2]}"
            busy = self.js(f"{PANEL}.sessionContext.session.kernel.status") != "idle"
            if not busy and all(s[1] is not None and "*" not in s[3] for s in state):
                return
            self.page.wait_for_timeout(500)
        raise AssertionError(f"cells did not finish in {timeout:g} s")

    def button(self, command: str):
        """A button of this notebook's toolbar, by the command it runs."""
        return self.page.locator(f"#{self.id} .jp-NotebookPanel-toolbar [data-command='{command}']")

    def shot(self, locator, name: str) -> None:
        self.n_shots += 1
        locator.screenshot(path=str(self.shots / f"{self.n_shots:02d}_{name}.png"))

    def reload(self) -> None:
        """Load the page again, as a learner reopening the lab's tab does: the same notebook and kernel."""
        self.page.reload()
        self.wait(f"{PANEL} && {PANEL}.content && {PANEL}.context.isReady", 120, "the notebook never opened again")
        self.id = self.js(f"{PANEL}.id")
        assert self.js(f"{PANEL}.context.path") == self.path, "another document is in front after the reload"

    def close(self) -> None:
        self.page.close()


def json_list(values) -> str:
    return "[" + ",".join(str(int(v)) for v in values) + "]"


def widget_snapshot(cell) -> str:
    """What a widget's user sees change: images, printed text and HTML outside the controls."""
    return cell.evaluate("""node => {
        const out = [...node.querySelectorAll('.jp-OutputArea-output img')].map(i => i.src);
        for (const el of node.querySelectorAll('.widget-output, .widget-html-content')) out.push(el.innerText);
        return out.join('\\n');
    }""")
