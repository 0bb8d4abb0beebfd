"""Progress in logs: outside a terminal or notebook, one plain line per N steps, no carriage returns.

The real path: the warm start's fit on the real tiny model, with stderr captured (not a TTY).
"""

from __future__ import annotations

import io

from agl_lab.engines.tiny import load_model_and_tokenizer
from agl_lab.engines.warmstart import fit_transcripts
from agl_lab.progress import LineProgress, progress_bar
from agl_lab.tasks import get_task


def test_warm_start_progress_in_a_log_is_one_line_per_tenth(capsys):
    model, tok = load_model_and_tokenizer()
    fit_transcripts(model, tok, get_task("lookup").demonstrations(20 * 16, 0), 20, 0, progress="warm start")
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.strip().splitlines()
    assert [line.split(" · ")[0] for line in lines] == [f"warm start: {n}/20 ({5 * n}%)" for n in range(2, 21, 2)]
    assert "loss=" in lines[-1]


def test_a_terminal_gets_tqdm_and_a_pipe_gets_lines():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert not isinstance(progress_bar(total=3, desc="x", file=Tty()), LineProgress)
    out = io.StringIO()
    bar = progress_bar(total=3, desc="x", file=out, every=1)
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert [line.split(" · ")[0] for line in out.getvalue().splitlines()] == [
        "x: 1/3 (33%)",
        "x: 2/3 (67%)",
        "x: 3/3 (100%)",
    ]
    quiet = io.StringIO()
    bar = progress_bar(total=3, desc="x", file=quiet, disable=True)
    bar.update(3)
    bar.close()
    assert quiet.getvalue() == ""
