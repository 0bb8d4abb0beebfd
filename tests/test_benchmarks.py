"""The benchmark scripts still run end to end and print every row of their tables.

They time nothing here (timing stays out of tests): the smallest settings, then the table's
rows and columns are checked, so a script broken by a refactor fails in CI rather than in
the next benchmarking session.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: float = 240) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _rows(out: str, first_column: str) -> dict[str, list[str]]:
    """The table whose header starts with `first_column`: {first cell: cells} per data row."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\s*{re.escape(first_column)}\s*\|", line))
    rows = {}
    for line in lines[start + 2:]:
        if "|" not in line:
            break
        cells = [c.strip() for c in line.split("|")]
        rows[f"{cells[0]}@{cells[1]}"] = cells
    return rows


@pytest.mark.slow
def test_gateway_benchmark_prints_every_server_and_the_store_table():
    # two rounds: the servers take turns and each keeps its client session across them
    out = _run("benchmarks/gateway.py", "--agents", "1", "--rounds", "2", "--pairs", "4", "--seconds", "0.3",
               "--events", "50", "--no-agl")
    gateway = _rows(out, "server")
    assert set(gateway) == {f"{name}@1" for name in ("memory", "sqlite", "floor", "floor+json", "uvicorn+json")}
    for cells in gateway.values():
        assert len(cells) == 18 and all(cells), cells
        assert float(cells[8].replace(",", "")) > 0  # calls/s: the throughput phase made calls
    # without agentlightning the AGL columns come from issue #17's figures, and say so
    assert "issue #17's figures (agentlightning not importable)" in out
    assert gateway["memory@1"][15] != "n/a" and gateway["memory@1"][17] == "n/a"  # no ceiling figure at 1 agent
    store = _rows(out, "store")
    assert set(store) == {"memory@50", "sqlite@50"}


@pytest.mark.slow
def test_batch_benchmark_prints_both_levels():
    out = _run("benchmarks/batch.py", "--repeat", "1", "--no-agl")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["trajectory"], ["transition"])}
    assert rows["trajectory"][1] == "512" and rows["transition"][1] == "4096"  # one row per rollout / per call
    assert rows["trajectory"][3:5] == ["433", "(issue)"]  # AGL's figure from issue #17, labelled
    assert "nan" not in out
    assert "issue #17's figures (agentlightning not importable)" in out
