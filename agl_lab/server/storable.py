"""What the store accepts: one rule for every backend — a stored value can be read back and sent.

    check_storable(value, where)   strict walk (API writes): raises NotStorable naming the field
    dump_storable(value, where)    fast orjson encode (gateway/event hot path): bytes or NotStorable
    check_rollout_id(rid)          the documented rollout/attempt id alphabet and length

The rule (a value that breaks it answers 422 and nothing is stored):

    strings      valid Unicode (no lone UTF-16 surrogate such as "\\ud800"), keys too; no NUL
                 (U+0000): PostgreSQL's text cannot hold it, and one in a rollout's JSON stops
                 its lease sweep. Event data (`nul_ok=True`: the API's event route, the gateway's
                 bodies) may hold it: every backend keeps it as JSON's "\\u0000" in bytes.
    integers     signed 64-bit: -2**63 <= i <= 2**63 - 1 (SQLite/orjson read larger ones back as floats)
    floats       finite (JSON has no NaN/Infinity; the response encoder refuses them)
    nesting      at most MAX_DEPTH containers deep (the readers stop at ~200 levels)

`check_storable` is a Python walk that names the offending path (`input.a[3]`); it runs on
the API's write routes, whose bodies are small. The gateway's hot path records bodies that
orjson already parsed (no NaN, no surrogates, ints within u64), so it only needs the nesting
bound: `dump_storable` gets it from one orjson encode by wrapping the value in
`_ORJSON_DEPTH - MAX_DEPTH` lists (orjson refuses to encode deeper than its recursion limit)
and returns the encoding without the wrapper, which the backends store as is.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is optional
    orjson = None  # type: ignore[assignment]

MAX_DEPTH = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_ORJSON_DEPTH = 254  # orjson.dumps encodes 254 nested containers and refuses 255
_WRAP = _ORJSON_DEPTH - MAX_DEPTH

ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9._:@+=-]{1,128}$"
ROLLOUT_ID_RULE = "1-128 characters from A-Z a-z 0-9 . _ : @ + = -, not '.' or '..'"
_DOT_SEGMENTS = (".", "..")  # HTTP clients remove them from a URL path: no route could reach the rollout
_ID_RE = re.compile(ROLLOUT_ID_PATTERN)


class NotStorable(ValueError):
    """A value the store refuses; `field` names where it is (e.g. `input.messages[2].content`)."""

    def __init__(self, field: str, problem: str):
        shown = field if len(field) <= 120 else f"{field[:80]}...{field[-30:]}"
        super().__init__(f"{shown}: {problem}")
        self.field, self.problem = field, problem


def check_rollout_id(rollout_id: str, what: str = "rollout_id") -> str:
    """Raise NotStorable unless `rollout_id` matches ROLLOUT_ID_PATTERN; returns it."""
    if not isinstance(rollout_id, str) or not _ID_RE.match(rollout_id) or rollout_id in _DOT_SEGMENTS:
        raise NotStorable(what, f"{rollout_id!r} is not a valid id: use {ROLLOUT_ID_RULE}")
    return rollout_id


def check_storable(value: Any, where: str = "data", *, nul_ok: bool = False) -> None:
    """Raise NotStorable (naming the path) unless `value` is storable JSON (module rule); NUL in
    a string only where `nul_ok` (event data)."""
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        v, path, depth = stack.pop()
        kind = type(v)
        if kind is str:
            _check_str(v, path, nul_ok)
        elif kind is bool or v is None:
            continue
        elif kind is int or isinstance(v, int):
            if not INT64_MIN <= v <= INT64_MAX:
                raise NotStorable(path, f"integer {_short(v)} is outside the signed 64-bit range")
        elif kind is float or isinstance(v, float):
            if not math.isfinite(v):
                raise NotStorable(path, f"{v} is not a finite number (JSON has no NaN/Infinity)")
        elif isinstance(v, dict):
            if depth >= MAX_DEPTH:
                raise NotStorable(path, f"nested deeper than {MAX_DEPTH} levels")
            for k, x in v.items():
                if not isinstance(k, str):
                    raise NotStorable(path, f"object key {k!r} is not a string")
                _check_str(k, f"{path} key", nul_ok)
                stack.append((x, f"{path}.{k}" if _plain_key(k) else f"{path}[{k!r}]", depth + 1))
        elif isinstance(v, (list, tuple)):
            if depth >= MAX_DEPTH:
                raise NotStorable(path, f"nested deeper than {MAX_DEPTH} levels")
            stack.extend((x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v))
        else:
            raise NotStorable(path, f"a {type(v).__name__} is not a JSON value")


def dump_storable(value: Any, where: str = "data") -> bytes:
    """orjson-encode `value`; NotStorable when it is nested too deep or not encodable.

    Does not see NaN/Infinity (orjson writes null): callers hand it orjson-parsed bodies or
    values that passed `check_storable`.
    """
    if orjson is None:  # pragma: no cover - orjson is optional
        check_storable(value, where)
        import json

        return json.dumps(value).encode()
    outer, inner = _wrapper()
    inner[0] = value
    try:
        encoded = orjson.dumps(outer)
    except TypeError:  # JSONEncodeError: recursion limit, surrogates, ints beyond u64, odd types
        check_storable(value, where)  # names the field and the problem
        raise NotStorable(where, "not encodable as JSON") from None
    finally:
        inner[0] = None
    return encoded[_WRAP:-_WRAP]


_local = threading.local()


def _wrapper() -> tuple[list[Any], list[Any]]:
    """This thread's `_WRAP` nested lists (outermost, innermost), built once per thread."""
    chain = getattr(_local, "chain", None)
    if chain is None:
        inner: list[Any] = [None]
        outer = inner
        for _ in range(_WRAP - 1):
            outer = [outer]
        chain = _local.chain = (outer, inner)
    return chain


def _check_str(s: str, path: str, nul_ok: bool = False) -> None:
    if not nul_ok and "\x00" in s:
        raise NotStorable(path, "string holds a NUL character (U+0000), which PostgreSQL cannot store: remove it")
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise NotStorable(path, "string holds a lone UTF-16 surrogate (invalid Unicode)") from None


def _plain_key(key: str) -> bool:
    return key.isidentifier()


def _short(v: int) -> str:
    text = str(v)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"
