"""The keys of `agl-lab serve` and `agl-lab runner`, checked when the command starts (a leaf: stdlib only).

    key_problem(key)                  why no client could present `key` in a header (None: it can)
    checked_key(key, source, prog)    `key`, or SystemExit naming where it came from and the fix
    key_source(args)                  where a command took its key from (--key, --key-file PATH, AGL_KEY)
    readable_by_others(path)          a key file's mode when its group or others have access (None: private)
    warn_if_shared(path, flag, prog)  one warning line for such a file

A key travels in an HTTP header (`Authorization: Bearer <key>` or `x-api-key`), which carries
printable ASCII and inner spaces only, and loses surrounding whitespace on the way. A server
started with a key outside that (`AGL_KEY='ключ-1'`, `' key '`, a key file of two lines) answers
401 to every client forever, so both commands refuse it at start in one line (exit 2), naming the
key's source, never the key. A key file its group or others may read is read with one warning line,
as libpq warns about `~/.pgpass`. The runner imports this module: it stays free of the server stack.
"""

from __future__ import annotations

import os
import stat
import sys
from typing import Any


def key_problem(key: str) -> str | None:
    """Why no client could present `key` in a header (None: it can be presented). The reasons are
    phrased to follow "the key ..." and never quote the key (it would land in logs)."""
    if key != key.strip(" \t\r\n\f\v"):
        return "begins or ends with whitespace, which HTTP strips from a header: remove it"
    for position, char in enumerate(key, 1):
        if char in "\r\n":
            return f"spans several lines (a line break at character {position}): keep the key on one line"
        if not " " <= char <= "~":  # Critical: a header is ASCII; the guard compares bytes
            kind = "a control character" if char.isascii() else "a non-ASCII character"
            return (
                f"holds {kind} at character {position}, which a header cannot carry: use ASCII letters, digits "
                "and punctuation (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
    return None


def readable_by_others(path: str) -> str | None:
    """The octal mode of file `path` when its group or others may read or write it (None: private,
    or not a file we can stat)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None
    return f"{mode:04o}" if mode & 0o077 else None


def key_source(args: Any, env_name: str = "AGL_KEY") -> str:
    """Where `server_key` took the key of `args` (parsed --key/--key-file flags) from, as a user would name it."""
    if getattr(args, "key", None) is not None:
        return getattr(args, "key_named", "--key")  # a key a config file gave (agl-lab runner CONFIG)
    key_file = getattr(args, "key_file", None)
    return f"--key-file {key_file}" if key_file is not None else env_name


def checked_key(key: str, source: str, prog: str) -> str:
    """`key` when a client can present it (SystemExit naming `source` and the fix otherwise); a key
    file (`source` "--flag PATH") others may read is warned about."""
    problem = key_problem(key) if key else None
    if problem is not None:
        raise SystemExit(f"{prog}: the key from {source} {problem}")
    path = source.partition(" ")[2]
    if path:
        warn_if_shared(path, source.partition(" ")[0], prog)
    return key


def warn_if_shared(path: str, flag: str, prog: str) -> None:
    """One warning line when `path` (a key file) has group or other access, as libpq warns for ~/.pgpass."""
    mode = readable_by_others(path)
    if mode is not None:
        print(
            f"{prog}: warning: {flag} {path} has group or other access (mode {mode}); "
            f"it holds a secret: chmod 600 {path}",
            file=sys.stderr,
            flush=True,
        )
