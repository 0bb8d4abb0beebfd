"""The rollout store: one `Store` interface (`base`), one module per backend.

    base.py        the interface and its semantics (AGL v1's data model)
    errors.py      the store's errors (the app maps each to an HTTP code)
    memory.py      MemoryStore    `store: memory` (default; lost when the process ends)
    sqlite.py      SqliteStore    `store: sqlite:///path/to/store.db` (one server process per file)
    postgresql.py  PostgresStore  `store: postgresql://...` (any number of server processes)

`agl_lab.server.backends.open_store(url)` picks one by URL. The public names are re-exported
here (`from agl_lab.server.store import MemoryStore, RolloutNotFound`); `PostgresStore` and
`SchemaMismatch` are imported on first use, so a process that never opens PostgreSQL does not
import its driver (psycopg).
"""

from __future__ import annotations

from typing import Any

from agl_lab.server.store.base import DEFAULT_TERMINAL_LOG_LIMIT, ReusedAttempt, StaleAttempt, Store, next_attempt_id
from agl_lab.server.store.errors import (
    EventIdReused,
    InvalidTransition,
    RolloutNotFound,
    StoreError,
    StoreLocked,
    StoreUnavailable,
)
from agl_lab.server.store.memory import MemoryStore
from agl_lab.server.store.sqlite import SqliteStore

__all__ = [
    "DEFAULT_TERMINAL_LOG_LIMIT",
    "EventIdReused",
    "InvalidTransition",
    "MemoryStore",
    "PostgresStore",
    "ReusedAttempt",
    "RolloutNotFound",
    "SchemaMismatch",
    "SqliteStore",
    "StaleAttempt",
    "Store",
    "StoreError",
    "StoreLocked",
    "StoreUnavailable",
    "next_attempt_id",
]


def __getattr__(name: str) -> Any:
    if name in ("PostgresStore", "SchemaMismatch"):  # psycopg only for a process that uses it
        from agl_lab.server.store import postgresql

        return getattr(postgresql, name)
    raise AttributeError(f"module 'agl_lab.server.store' has no attribute {name!r}")
