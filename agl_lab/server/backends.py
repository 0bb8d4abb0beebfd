"""`open_store(url)`: the one place that picks a store backend (`agl_lab.server.store`).

    None | "memory"                          -> MemoryStore    lost when the process ends
    "sqlite:///rel/path.db" | "sqlite:////abs/path.db"
                                             -> SqliteStore    one server process per file
    "postgresql://user:pass@host:5432/db"    -> PostgresStore  any number of server processes
    (or "postgres://...")                                      (agl_lab.server.store.postgresql)

It lives apart from the `store` package so that importing the package does not import the
PostgreSQL driver; this factory imports `PostgresStore` (and psycopg) only when a URL names
PostgreSQL, so a process with the default store runs without psycopg installed.
"""

from __future__ import annotations

from agl_lab.server.store import DEFAULT_TERMINAL_LOG_LIMIT, MemoryStore, SqliteStore, Store

STORE_URLS = "'memory' (default), 'sqlite:///path/to/store.db' or 'postgresql://user:password@host:5432/database'"


def open_store(
    url: str | None = None, *, terminal_log_limit: int = DEFAULT_TERMINAL_LOG_LIMIT, timeout_seconds: float = 2.0
) -> Store:
    """The store `url` names (the `store` setting); ValueError naming the accepted forms otherwise.
    `timeout_seconds` (PostgreSQL: the `store_timeout_seconds` setting) bounds a call's wait for a connection."""
    if url is None or url in ("memory", "memory://", ""):
        return MemoryStore(terminal_log_limit)
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        if not path:
            raise ValueError(f"store url {url!r} names no file: use 'sqlite:///path/to/store.db'")
        return SqliteStore(path, terminal_log_limit)
    if is_postgres_url(url):
        from agl_lab.server.store.postgresql import PostgresStore  # psycopg: only where PostgreSQL is used

        return PostgresStore(url, terminal_log_limit, pool_timeout=timeout_seconds)
    raise ValueError(f"unknown store url {url!r}: use {STORE_URLS}")


def is_postgres_url(url: str | None) -> bool:
    """The store `url` names PostgreSQL (and so needs psycopg and psycopg-pool)."""
    return bool(url) and str(url).startswith(("postgresql://", "postgres://"))
