"""A private Ray temp dir for a test module that starts a real Ray cluster (verl on CPU, vLLM).

Ray's socket paths must stay short (a short prefix under /tmp), and RAY_AUTH_MODE is off for
tests; both variables are put back as they were, and the directory removed, afterwards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def isolated_ray_env(prefix: str) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_AUTH_MODE")}
    os.environ.update(RAY_TMPDIR=path, RAY_AUTH_MODE="disabled")
    try:
        yield path
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(path, ignore_errors=True)
