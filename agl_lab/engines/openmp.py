"""One busy OpenMP team at a time: a thread that stops computing gives its thread pool back.

torch's CPU wheels run their parallel ops on GNU OpenMP (libgomp), which keeps one pool of worker
threads per thread that ever ran a parallel region, for that thread's lifetime. A worker spins for a
while after each region, so the next one starts at once — unless libgomp manages more threads, over
all pools, than the process has cores: then it "throttles", spinning ~100 times and going to sleep,
and every parallel region waits for its workers to be woken. The local engine has two computing
threads (the trainer's, which runs the update, and the decode loop's), each with a pool of
`torch.get_num_threads()`; on a 2-core machine the idle pool alone throttled the busy one. Measured
on SmolLM2-135M + LoRA (`benchmarks/openmp_pools.py`): a decode step of 1 row 38 → 55 ms, 16 rows
63 → 82 ms, with the other thread's pool idle beside it.

`release_threads()` frees the calling thread's pool (OpenMP 5's `omp_pause_resource_all`, soft); its
next parallel region starts a new one (a few thread creations). The decode loop calls it when it runs
out of work, the trainer's thread when a rollout phase begins (`LocalEngine.resume`), so whichever
thread computes has the cores' only pool. Elsewhere (another OpenMP runtime, no OpenMP) it does
nothing and says so by returning False.
"""

from __future__ import annotations

import ctypes
import functools
import re

_PAUSE_SOFT = 1  # omp_pause_soft: the runtime's threads end; the next parallel region starts new ones


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime this process has loaded (torch's own copy in its wheel), if any."""
    import torch  # noqa: F401  (loads the runtime torch runs on)

    try:
        with open("/proc/self/maps") as maps:
            paths = set(re.findall(r"(/\S*/libgomp[^/\s]*\.so[^/\s]*)", maps.read()))
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        lib = ctypes.CDLL(path)  # already loaded: the same handle
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            return lib
    return None


def available() -> bool:
    """Whether `release_threads` can act here (torch on GNU OpenMP ≥ 9)."""
    return _libgomp() is not None


def release_threads() -> bool:
    """Free the calling thread's OpenMP worker threads; True when they were (or there were none)."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(_PAUSE_SOFT) == 0
