"""Test time that scales with the machine: AGL_LAB_TEST_TIME_SCALE (a float, default 1).

    scaled(seconds)          seconds × the scale: start-up waits, leases, windows, limits
    scale_timeouts(config, items)   pytest-timeout's limits × the scale; notebook cells ≥ 20 min

A busy or slow machine (a laptop on battery, CI beside other jobs) sets AGL_LAB_TEST_TIME_SCALE=3
(docs/setup.md). Scale a lease and the beat that renews it together: their ratio is what a test
relies on, and it stays ≥ 10.
"""

from __future__ import annotations

import os

import pytest

_SCALED = pytest.StashKey[bool]()


def _time_scale() -> float:
    raw = os.environ.get("AGL_LAB_TEST_TIME_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"AGL_LAB_TEST_TIME_SCALE={raw!r} is not a number: set a float such as 1 or 3") from None
    if not scale > 0:
        raise ValueError(f"AGL_LAB_TEST_TIME_SCALE={raw!r} must be above 0 (1 = as written, 3 = three times longer)")
    return scale


TIME_SCALE = _time_scale()


def scaled(seconds: float) -> float:
    """`seconds` times AGL_LAB_TEST_TIME_SCALE: for start-up waits, leases, windows and limits that a
    busy machine could outrun. Scale a lease and its heartbeat together: their ratio is what matters."""
    return seconds * TIME_SCALE


NOTEBOOK_CELL_SECONDS = 1200.0  # a notebook cell's pytest-timeout: a training cell beside busy jobs took > 300 s


def _timeout_of(item: pytest.Item, default: float) -> float:
    mark = item.get_closest_marker("timeout")
    if mark is None:
        return default
    value = mark.args[0] if mark.args else mark.kwargs.get("timeout", default)
    return float(value or 0)


def scale_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-timeout's limits (the ini's `timeout`, a test's own mark) times AGL_LAB_TEST_TIME_SCALE;
    a notebook cell (nbval) gets at least NOTEBOOK_CELL_SECONDS. Called by tests/conftest.py and
    notebooks/conftest.py (each item once)."""
    try:
        default = float(config.getoption("timeout", None) or config.getini("timeout") or 0)
    except (ValueError, TypeError):  # pytest-timeout not installed
        return
    for item in items:
        if item.stash.get(_SCALED, False):
            continue
        item.stash[_SCALED] = True
        seconds = _timeout_of(item, default)
        notebook = type(item).__name__ == "IPyNbCell"
        if seconds <= 0 or (TIME_SCALE == 1 and not notebook):
            continue
        if notebook:
            seconds = max(seconds, NOTEBOOK_CELL_SECONDS)
        item.add_marker(pytest.mark.timeout(scaled(seconds)), append=False)  # the closest mark wins
