"""Generate the tutorial notebooks from their Python source, execute them, strip what is volatile.

    python scripts/build_notebooks.py              # all notebooks
    python scripts/build_notebooks.py 02           # those whose name contains "02"
    python scripts/build_notebooks.py --no-execute # regenerate cells only (no outputs)

The source of `notebooks/NAME.ipynb` is `notebooks/src/NAME.py` in the "percent" format:
``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell whose lines carry a
leading ``# ``. Keeping the source as plain Python makes reviews and diffs readable; the
notebook is a build product, committed *with* its outputs so that it reads (plots and
token renderings included) without a kernel.

Determinism. Cell ids are `cell-NN` (nbformat would draw random ones), the kernel runs in
`notebooks/` like nbval runs it, and after execution the script removes what changes from
run to run without meaning anything: per-cell timing metadata, the saved widget state, the
kernel's version strings, and the live widget view of a display (the static HTML fallback
beside it stays — a saved widget view without its state renders as an error). Outputs that
genuinely vary (timings in a lifecycle plot) remain; nbval only compares the cells marked
``# NBVAL_CHECK_OUTPUT``, with `notebooks/sanitize.cfg` for ids and timings.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SOURCES = NOTEBOOKS / "src"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
RICH = ("text/html", "image/png", "image/svg+xml")
PLAIN_LIMIT = 2000  # characters of text/plain kept beside a rich representation
_MARKER = re.compile(r"^# %%(?P<md> \[markdown\])?\s*$")


# =========================================================================== source → cells


def parse_percent(text: str) -> list[tuple[str, str]]:
    """[(cell_type, source)] of a percent-format file; text before the first marker is dropped."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        m = _MARKER.match(line)
        if m:
            cells.append(("markdown" if m.group("md") else "code", []))
        elif cells:
            cells[-1][1].append(line)
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            lines = [re.sub(r"^# ?", "", ln) for ln in lines]
        source = "\n".join(lines).strip("\n")
        if source:
            out.append((kind, source))
    return out


def make_notebook(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    for i, (kind, source) in enumerate(cells):
        cell = nbformat.v4.new_markdown_cell(source) if kind == "markdown" else nbformat.v4.new_code_cell(source)
        cell.id = f"cell-{i:02d}"
        nb.cells.append(cell)
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
        "language_info": {"name": "python"},
    }
    return nb


# =========================================================================== execute and clean


def execute(nb: nbformat.NotebookNode, timeout: int, timings: bool = False) -> float:
    """Run every cell in `notebooks/` (as nbval does); returns the wall time in seconds.

    timings=True prints the slowest cells (from nbclient's per-cell timing metadata).
    """
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=False,
        record_timing=timings,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    t0 = time.time()
    client.execute()
    if timings:
        spans = []
        for i, cell in enumerate(nb.cells):
            t = cell.metadata.get("execution", {})
            if "iopub.execute_input" in t and "shell.execute_reply" in t:
                seconds = (_ts(t["shell.execute_reply"]) - _ts(t["iopub.execute_input"])).total_seconds()
                spans.append((seconds, i, cell.source.splitlines()[0][:60]))
        for seconds, i, first in sorted(spans, reverse=True)[:6]:
            print(f"  {seconds:6.1f} s  cell {i:2d}  {first}")
    return time.time() - t0


def _ts(text: str):
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def strip_volatile(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop timing/widget-state metadata and live widget views; shorten redundant plain text.

    A widget view with a static HTML fallback keeps the fallback; a widget view without one
    (a progress bar) is dropped with its output. A long `text/plain` beside HTML or a picture
    (a dataclass repr) is cut: viewers show the rich form, and the file stays small.
    """
    nb.metadata.pop("widgets", None)
    nb.metadata["language_info"] = {"name": "python"}
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        kept = []
        for output in cell.get("outputs", []):
            data = output.get("data")
            if data and WIDGET_VIEW in data:
                if "text/html" not in data:
                    continue
                data.pop(WIDGET_VIEW)
            if data and any(k in data for k in RICH) and len(data.get("text/plain", "")) > PLAIN_LIMIT:
                data["text/plain"] = data["text/plain"][:PLAIN_LIMIT] + " …[cut by build_notebooks.py]"
            output.pop("transient", None)
            kept.append(output)
        if cell.cell_type == "code":
            cell.outputs = kept
    return nb


def build(name: str, *, run: bool, timeout: int, timings: bool = False) -> float | None:
    source = SOURCES / f"{name}.py"
    nb = make_notebook(parse_percent(source.read_text()))
    try:
        wall = execute(nb, timeout, timings) if run else None
    except Exception:
        failed = Path(tempfile.gettempdir()) / f"{name}.failed.ipynb"
        nbformat.write(nb, failed)  # the outputs up to the failing cell, for debugging
        print(f"notebooks/{name}.ipynb failed; partial run written to {failed}", file=sys.stderr)
        raise
    nbformat.validate(strip_volatile(nb))
    nbformat.write(nb, NOTEBOOKS / f"{name}.ipynb")
    return wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="build only notebooks whose name contains one of these")
    parser.add_argument("--no-execute", action="store_true", help="write the cells without running them")
    parser.add_argument("--timeout", type=int, default=300, help="per-cell timeout in seconds")
    parser.add_argument("--timings", action="store_true", help="print the slowest cells")
    args = parser.parse_args(argv)
    names = sorted(p.stem for p in SOURCES.glob("*.py"))
    names = [n for n in names if not args.only or any(o in n for o in args.only)]
    if not names:
        print(f"no notebook source matches {args.only} in {SOURCES}", file=sys.stderr)
        return 2
    for name in names:
        wall = build(name, run=not args.no_execute, timeout=args.timeout, timings=args.timings)
        print(f"notebooks/{name}.ipynb" + ("" if wall is None else f"  executed in {wall:.1f} s"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
