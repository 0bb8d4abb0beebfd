"""agl_lab.heap: freed heap pages go back to the OS at the end of each update (flat RSS)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from agl_lab import heap
from tests.trainer_runs import SMALL

_LIBC = ctypes.util.find_library("c")


@pytest.mark.skipif(heap._malloc_trim() is None, reason="no glibc malloc_trim on this platform")
def test_trim_returns_freed_blocks_to_the_os():
    libc = ctypes.CDLL(_LIBC)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    heap.trim()
    block = 64 * 1024  # under glibc's mmap threshold: these come from the heap and stay there when freed
    blocks = [libc.malloc(block) for _ in range(3000)]
    for b in blocks:
        ctypes.memset(b, 1, block)  # touched: resident
    for b in blocks[:-1]:
        libc.free(b)  # the last one pins the top of the heap: only malloc_trim gives the rest back
    try:
        metrics = heap.trim()
    finally:
        libc.free(blocks[-1])
    assert metrics["perf/heap_trimmed_gb"] * 2**30 > 100 * 2**20  # ~190 MB were freed above
    assert 0 < metrics["perf/rss_gb"] < 64


def test_disabled_trim_reports_only_the_resident_size(monkeypatch):
    monkeypatch.setattr(heap, "ENABLED", False)
    metrics = heap.trim()
    assert set(metrics) == {"perf/rss_gb"}  # nothing was trimmed: no trimmed figure, not a 0


def test_an_update_reports_its_resident_size_and_trim():
    from agl_lab.trainer import Trainer

    with Trainer.from_config("configs/cpu_tiny.yaml", overrides=SMALL) as trainer:
        trainer.rollout()
        trainer.build_batch()
        update = trainer.update()
    assert update.metrics["perf/rss_gb"] > 0
    assert "timing_s/trim_heap" in update.metrics
    if heap._malloc_trim() is not None:
        assert update.metrics["perf/heap_trimmed_gb"] >= 0
