"""Progress bars that suit where they are shown.

    progress_bar(total=N, desc="…", **tqdm_kwargs)

A terminal or a notebook gets tqdm's bar (`tqdm.auto`). Anything else — a log file, CI, a
pipe — gets `LineProgress`: one plain line every `every` steps (default: a tenth of the total)
and one at the end, instead of a bar redrawn with carriage returns into one huge line.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _interactive(stream: TextIO) -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if type(shell).__name__ == "ZMQInteractiveShell":  # a Jupyter kernel: tqdm.auto draws a widget
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class LineProgress:
    """The tqdm methods agl_lab uses (`update`, `set_postfix`, `close`), as plain lines:
    `desc: 20/200 (10%) · 4.1 s · loss=0.512`."""

    def __init__(
        self,
        total: int | None = None,
        desc: str = "",
        initial: int = 0,
        every: int | None = None,
        file: TextIO | None = None,
        disable: bool = False,
        **_: Any,
    ):
        self.total, self.desc, self.n = total, desc, initial
        self.every = every or max(1, (total or 10) // 10)
        self.file, self.disable = file, disable
        self.postfix = ""
        self.t0 = time.monotonic()
        self._last = initial
        self._closed = False

    def _line(self) -> None:
        done = f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total else str(self.n)
        postfix = f" · {self.postfix}" if self.postfix else ""
        print(
            f"{self.desc}: {done} · {time.monotonic() - self.t0:.1f} s{postfix}",
            file=self.file or sys.stderr,
            flush=True,
        )

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.disable and self.n - self._last >= self.every and (not self.total or self.n < self.total):
            self._last = self.n
            self._line()

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self._closed and not self.disable:
            self._line()
        self._closed = True


def progress_bar(total: int | None = None, desc: str = "", *, file: TextIO | None = None, **kwargs: Any) -> Any:
    """tqdm's bar in a terminal or notebook, else a `LineProgress` (one line per `every` steps)."""
    if _interactive(file or sys.stderr):
        from tqdm.auto import tqdm

        kwargs.pop("every", None)
        return tqdm(total=total, desc=desc, file=file, **kwargs)
    return LineProgress(total=total, desc=desc, file=file, **kwargs)
