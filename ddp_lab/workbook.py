"""Render every notebook, executed top to bottom, to HTML handouts.

    python -m ddp_lab.workbook build/workbook        # what `make workbook` runs
    python -m ddp_lab.workbook build/workbook --store                        # and keep the outputs
    python -m ddp_lab.workbook build/workbook --store notebooks/08_profiling.ipynb   # just these

Writes one HTML file per notebook (solutions too) and an index.html listing each
lesson with the time its execution took on this machine, for planning a workshop.
A notebook that fails is reported by name, the others are still rendered, and the
exit code is non-zero. `--store` writes each executed notebook back over its .ipynb
(outputs and widget state), so the outputs readers see on GitHub come from one
top-to-bottom run of lessons and solutions together; a notebook that failed is left
as it was.
"""
from __future__ import annotations

import html
import json
import sys
import time
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def title_of(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return "untitled"


def render(path: Path, out_dir: Path, timeout: int = 600, store: bool = False) -> tuple[str, float, str | None]:
    import nbformat
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import CellExecutionError, ExecutePreprocessor

    nb = nbformat.read(path, as_version=4)
    start, error = time.time(), None
    try:
        ExecutePreprocessor(timeout=timeout, kernel_name="python3", store_widget_state=True).preprocess(
            nb, {"metadata": {"path": str(path.parent)}})
    except CellExecutionError as e:
        error = str(e).strip().splitlines()[-1][:300]
    seconds = time.time() - start
    if store and error is None:
        nbformat.write(nb, path)
    body, _ = HTMLExporter().from_notebook_node(nb)
    (out_dir / path.with_suffix(".html").name).write_text(body, encoding="utf-8")
    return title_of(nb), seconds, error


def main(argv: list[str]) -> int:
    store = "--store" in argv
    args = [a for a in argv if a != "--store"]
    out_dir = Path(args[0] if args else "build/workbook")
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
    rows, failed = [], []
    for path in tqdm(paths, desc="executing notebooks", unit="nb"):
        title, seconds, error = render(path, out_dir, store=store)
        rows.append((path, title, seconds, error))
        if error:
            failed.append(f"{path.name}: {error}")
    items = "\n".join(
        f'<tr><td><a href="{p.with_suffix(".html").name}">{html.escape(p.stem)}</a></td>'
        f"<td>{html.escape(t)}</td><td>{s:.0f} s</td><td>{'FAILED' if e else 'ok'}</td></tr>"
        for p, t, s, e in rows)
    (out_dir / "index.html").write_text(
        "<!doctype html><meta charset=utf-8><title>DDP Lab workbook</title>"
        "<h1>DDP Lab workbook</h1><p>Executed on this machine; times are execution only.</p>"
        f"<table border=1 cellpadding=4><tr><th>file</th><th>title</th><th>ran in</th><th></th></tr>{items}</table>",
        encoding="utf-8")
    (out_dir / "timings.json").write_text(json.dumps(
        [{"notebook": p.name, "title": t, "seconds": round(s, 1), "ok": not e} for p, t, s, e in rows], indent=1))
    print(f"wrote {len(rows)} handouts to {out_dir}/ (open index.html)")
    for line in failed:
        print("FAILED", line, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
