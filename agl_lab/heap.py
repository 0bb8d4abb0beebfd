"""Hand freed heap memory back to the operating system at the end of each update.

A step allocates and frees gigabytes on CPU (the update's activations and gradients, the
engine's merged LoRA weights and KV slabs). glibc's malloc keeps what is freed in its arenas
for reuse, so the process's resident size climbs for several steps and stays at the high-water
mark of the worst step: on the SmolLM2 `calc` recipe 4.45 → 4.86 GB over six steps, although
the live Python objects and tensors do not grow (measured with `benchmarks/memory.py`: the
count of live tensors is flat). `malloc_trim(0)` returns the free pages; after it the same run
sits at 2.5 GB between steps, flat from step 1.

    trim() -> {"perf/rss_gb": resident size after, "perf/heap_trimmed_gb": given back}

On a platform without glibc (macOS, musl) there is nothing to call: `trim()` then returns only
`perf/rss_gb` (where /proc gives it), and `perf/heap_trimmed_gb` is absent rather than 0.
`ENABLED = False` turns the trim off (the benchmark compares both in one run).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

ENABLED = True
_GB = 2**30


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def rss_bytes() -> int | None:
    """This process's resident set size in bytes (Linux /proc), or None where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _page_size()
    except (OSError, ValueError, IndexError):
        return None


@functools.cache
def _page_size() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE")


def trim() -> dict[str, float]:
    """Give free heap pages back to the OS; the resident size after, and how much went back."""
    before = rss_bytes()
    fn = _malloc_trim() if ENABLED else None
    if fn is not None:
        fn(0)
    after = rss_bytes()
    metrics: dict[str, float] = {}
    if after is not None:
        metrics["perf/rss_gb"] = after / _GB
        if fn is not None and before is not None:
            metrics["perf/heap_trimmed_gb"] = max(before - after, 0) / _GB
    return metrics
