"""Render every notebook, executed top to bottom, to HTML handouts.

    python -m ddp_lab.engine.workbook build/workbook        # what `make workbook` runs
    python -m ddp_lab.engine.workbook build/workbook --store                        # and keep the outputs
    python -m ddp_lab.engine.workbook build/workbook --store notebooks/08_profiling.ipynb   # just these
    python -m ddp_lab.engine.workbook build/workbook --store --workshop docs/workshop.md    # and its timing table

Writes one HTML file per notebook (solutions too) and an index.html listing each
lesson with the time its execution took on this machine, for planning a workshop.
A notebook that fails is reported by name, the others are still rendered, and the
exit code is non-zero. Each notebook that passed also gets its Chinese handout in zh/, from its
Chinese edition (`ddp_lab.engine.zh`: the English outputs, the catalog's markdown), rendered without
running it again; a notebook whose catalog is incomplete is named and left out. `--store` writes each executed notebook back over its .ipynb
(its outputs; a widget as the sentence it shows until its cell runs), so the outputs readers see on GitHub come from one
top-to-bottom run of lessons and solutions together; a notebook that failed is left
as it was.

Every run writes timings.json (date, machine: cores, platform, torch version; per notebook
its title, seconds, whether it passed, and the seconds of its core path and of its deep dives:
see `ddp_lab.engine.corepath`), and prints each lesson's times when it ends. With `--workshop
FILE` it also rewrites the timing table of the workshop guide between `<!-- timings:start -->`
and `<!-- timings:end -->`: the row of each lesson that ran and passed gets its time, its core
path's time and where they were measured; the rows of lessons that failed or did not run keep
what they said, so a partial run never erases a measurement. A lesson without a row gets one.
"""
from __future__ import annotations

import html
import json
import os
import platform
import re
import sys
import time
from datetime import date
from pathlib import Path
from unittest import mock

from ddp_lab.engine import corepath
from ddp_lab.engine.launch import ROOT

NOTEBOOKS = ROOT / "notebooks"
START, END = "<!-- timings:start -->", "<!-- timings:end -->"
TABLE_HEADER = ["| notebook | topic | executes in | core path | measured on |", "|---|---|---|---|---|"]


def title_of(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return "untitled"


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "widgets"  # the notebook metadata key under which ipywidgets stores its models
WIDGET_TEXT = "(an interactive control: run the notebook from the top (Run menu: Run All Cells) to use it)"
WIDGET_REPR = re.compile(r"[A-Za-z_]\w*\(\w+=")  # VBox(children=..., interactive(children=...


def stored_widgets_as_text(nb):
    """A stored widget becomes the sentence its cell shows until it runs, and nothing else.

    Kept as a widget, it would draw from the stored state only when the notebook is trusted and
    only once the widget manager has caught up with the kernel, and then move without redrawing
    (the Python that redraws it is gone). A sentence shows the same in every lab, trusted or not,
    on GitHub and in nbviewer: what the cell does once run. The widget's own plain-text fallback
    stays when it wrote one (the stepper's); a repr (`VBox(children=(...`) becomes WIDGET_TEXT."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
                text = str(data.get("text/plain", ""))
                if not text or WIDGET_REPR.match(text):
                    data["text/plain"] = WIDGET_TEXT
    nb.metadata.pop(WIDGET_STATE, None)  # no output refers to the stored models any more
    return nb


def render(path: Path, out_dir: Path, timeout: int = 600, store: bool = False) -> tuple[str, float, str | None, dict]:
    import nbformat
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import CellExecutionError, ExecutePreprocessor

    nb = nbformat.read(path, as_version=4)
    start, error = time.time(), None
    # The solutions pass every exercise: their verdicts go to a scratch file beside the handouts, never
    # into the learner's grades (~/.ddp_lab/grades.json, or the file DDP_LAB_GRADES names).
    scratch = {"DDP_LAB_GRADES": str((out_dir / "grades.json").resolve())}
    if store:  # the stored run refreshes the records the notebooks ship (a learner's run keeps its own in runs/)
        scratch["DDP_LAB_STORE_RECORDS"] = "1"
    try:
        with mock.patch.dict(os.environ, scratch):  # the kernel inherits it; restored afterwards
            ExecutePreprocessor(timeout=timeout, kernel_name="python3").preprocess(
                nb, {"metadata": {"path": str(path.parent)}})
    except CellExecutionError as e:
        error = str(e).strip().splitlines()[-1][:300]
    seconds = time.time() - start
    parts = {f"{part}_seconds": corepath.seconds(nb.cells, part) for part in ("core", "deep")}
    stored_widgets_as_text(nb)  # handouts and stored notebooks alike: no widget that cannot redraw
    if store and error is None:
        nbformat.write(nb, path)
    body, _ = HTMLExporter().from_notebook_node(nb)
    (out_dir / path.with_suffix(".html").name).write_text(body, encoding="utf-8")
    return title_of(nb), seconds, error, parts


def render_zh(paths: list[Path], out_dir: Path, store: bool = False) -> list[str]:
    """The Chinese handouts: each notebook's Chinese edition, rebuilt from its English notebook as it
    now stands (the outputs just stored, under `store`), rendered without executing to out_dir/zh/.
    Under `store` notebooks/zh/ is rebuilt too. Returns what to print: a line for each notebook left
    out (its catalog is incomplete: the English handouts never wait on a translation), and the count.
    Notebooks from outside the workbook's notebooks/ have no Chinese edition."""
    import nbformat
    from nbconvert import HTMLExporter

    from ddp_lab.engine import zh
    lessons, edition = zh.NOTEBOOKS.resolve(), zh.ZH.resolve()
    ours = [p for p in paths if lessons in p.resolve().parents and edition not in p.resolve().parents]
    if not ours:
        return []
    if store:
        zh.build(ours)  # refuses, and says why, while a catalog is incomplete: then nothing is rewritten
    (out_dir / "zh").mkdir(parents=True, exist_ok=True)
    said = []
    for path in ours:
        text, todo = zh.translated(path)
        if todo:
            said.append(f"no Chinese handout for {path.stem}: {len(todo)} cells not translated (make zh-status)")
            continue
        body, _ = HTMLExporter().from_notebook_node(nbformat.reads(text, as_version=4))
        (out_dir / "zh" / path.with_suffix(".html").name).write_text(body, encoding="utf-8")
    return said + [f"wrote {len(ours) - len(said)} Chinese handouts to {out_dir / 'zh'}/"]


def machine() -> dict:
    """Where the timings were measured: what decides how long a lesson takes to execute."""
    try:
        import torch  # its own version says the build too (2.x+cpu, 2.x+cu130), which the wheel's metadata drops
        torch_version = str(torch.__version__)
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_version = "not installed"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cores": os.cpu_count(), "platform": platform.system(), "machine": platform.machine(),
            "python": platform.python_version(), "torch": torch_version,
            "load_average_at_start": None if load is None else round(load, 1)}


def lesson_id(name: str) -> str:
    """`01b_rank_by_rank.ipynb` -> `01b`: the key of a lesson's row in the workshop guide."""
    return Path(name).name.split("_", 1)[0]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _secs(s: float | None) -> str:
    return "—" if s is None else f"{s:.0f} s"


def update_timing_table(text: str, timings: dict) -> str:
    """`text` with the table between START and END rewritten from `timings` (timings.json's content).

    Only lessons (not solutions) that passed change their row; every other row stays as it was."""
    if START not in text or END not in text or text.index(START) > text.index(END):
        raise ValueError(f"no timing table: the file needs the markers {START} and {END}")
    head, rest = text.split(START, 1)
    table, tail = rest.split(END, 1)
    m = timings["machine"]
    where = f"{timings['date']}, {m['cores']} cores, {m['platform']}, torch {m['torch']}"
    new = {lesson_id(name): (t, f"{t['seconds']:.0f} s", _secs(t.get("core_seconds")))
           for name, t in timings["notebooks"].items() if t["ok"] and not Path(name).stem.endswith("_solutions")}
    rows = [line for line in table.strip().splitlines() if line.startswith("|")][2:]
    out, seen = [], set()
    for line in rows:
        cells = _cells(line)
        if len(cells) == 4:  # a table from before the core-path column
            cells = [*cells[:3], "—", cells[3]]
        key = cells[0].strip("`")
        seen.add(key)
        if key in new:
            cells = [cells[0], cells[1], new[key][1], new[key][2], where]
        out.append("| " + " | ".join(cells) + " |")
    for key in sorted(set(new) - seen):
        out.append(f"| {key} | {new[key][0]['title']} | {new[key][1]} | {new[key][2]} | {where} |")
    out.sort(key=lambda line: _cells(line)[0].strip("`"))
    return head + START + "\n" + "\n".join(TABLE_HEADER + out) + "\n" + END + tail


def main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m ddp_lab.engine.workbook", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", nargs="?", default="build/workbook", help="where the HTML handouts go")
    ap.add_argument("notebooks", nargs="*", help="only these notebooks (default: every lesson and solution)")
    ap.add_argument("--store", action="store_true", help="write each executed notebook back over its .ipynb")
    ap.add_argument("--workshop", metavar="GUIDE", help="rewrite the timing table of this guide "
                    "(e.g. docs/workshop.md) with the lessons that ran and passed")
    try:
        a = ap.parse_intermixed_args(argv)  # flags anywhere: out --store a.ipynb b.ipynb
    except SystemExit as e:  # --help (0) or a bad flag (2, after argparse's one-line message)
        return int(e.code or 0)
    store, workshop, args = a.store, Path(a.workshop) if a.workshop else None, [a.out_dir, *a.notebooks]
    if workshop is not None:
        try:  # before an hour of execution, not after it
            update_timing_table(workshop.read_text(encoding="utf-8"), {"date": "", "machine": {
                "cores": 0, "platform": "", "torch": ""}, "notebooks": {}})
        except (OSError, ValueError) as e:
            print(f"error: {workshop}: {e}", file=sys.stderr)
            return 2
    if Path(args[0]).suffix == ".ipynb":
        print(f"error: the first argument is the output folder, not a notebook: "
              f"python -m ddp_lab.engine.workbook build/workbook {args[0]}", file=sys.stderr)
        return 2
    out_dir = Path(args[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [Path(a).resolve() for a in args[1:]] or (
        sorted(NOTEBOOKS.glob("[0-9]*.ipynb")) + sorted((NOTEBOOKS / "solutions").glob("*.ipynb")))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"error: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; this only keeps the tool usable without it
        tqdm = lambda xs, **_: xs  # noqa: E731
    started = {"date": date.today().isoformat(), "machine": machine()}
    rows, failed = [], []
    for path in tqdm(paths, desc="executing notebooks", unit="nb"):
        title, seconds, error, parts = render(path, out_dir, store=store)
        rows.append((path, title, seconds, error, parts))
        if error:
            failed.append(f"{path.name}: {error}")
    items = "\n".join(
        f'<tr><td><a href="{p.with_suffix(".html").name}">{html.escape(p.stem)}</a></td>'
        f"<td>{html.escape(t)}</td><td>{s:.0f} s</td><td>{_secs(parts['core_seconds'])}</td>"
        f"<td>{'FAILED' if e else 'ok'}</td></tr>" for p, t, s, e, parts in rows)
    (out_dir / "index.html").write_text(
        "<!doctype html><meta charset=utf-8><title>DDP Lab workbook</title>"
        "<h1>DDP Lab workbook</h1><p>Executed on this machine; times are execution only.</p>"
        f"<table border=1 cellpadding=4><tr><th>file</th><th>title</th><th>ran in</th><th>core path</th><th></th></tr>{items}</table>",
        encoding="utf-8")
    timings = {**started, "notebooks": {
        p.name: {"title": t, "seconds": round(s, 1), "ok": not e,
                 **{k: v if v is None else round(v, 1) for k, v in parts.items()}} for p, t, s, e, parts in rows}}
    (out_dir / "timings.json").write_text(json.dumps(timings, indent=1) + "\n", encoding="utf-8")
    for name, t in timings["notebooks"].items():
        if t["ok"]:
            print(f"{Path(name).stem}: {t['seconds']:.0f} s, core path {_secs(t['core_seconds'])}, "
                  f"deep dives {_secs(t['deep_seconds'])}")
    print(f"wrote {len(rows)} handouts to {out_dir}/ (open index.html)")
    passed = [p for p, _, _, e, _ in rows if not e]
    for line in render_zh(passed, out_dir, store=store):
        print(line)
    if workshop is not None:
        workshop.write_text(update_timing_table(workshop.read_text(encoding="utf-8"), timings), encoding="utf-8")
        print(f"updated the timing table in {workshop} (lessons that passed)")
    for line in failed:
        print("FAILED", line, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
