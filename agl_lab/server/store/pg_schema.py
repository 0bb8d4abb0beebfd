"""The PostgreSQL store's tables: their DDL, and creating or checking them on open.

    agl_meta           schema_version
    agl_rollouts       seq, rollout_id UNIQUE, state, updated_at, active_at, body (Rollout JSON)
    agl_events         seq, rollout_id -> agl_rollouts ON DELETE CASCADE, attempt_id, event_type,
                       timestamp, data (JSON bytes)
    agl_models         (model, endpoint) -> version
    agl_terminal_log   idx (absolute), rollout_id;   agl_terminal_head: total
    agl_event_ids      (rollout_id, attempt_id, event_id) -> digest: client-made ids already stored
    agl_claimers       runner_id -> when it last claimed (fair shares across servers)

The last two came after schema version 1 was released: `_ADDED` creates them where missing, so a
database of version 1 opens as it is; so does `agl_event_ids.digest` (base.event_digest of the
event; '' in rows stored before it, which match any content).
"""

from __future__ import annotations

from typing import Any

import psycopg

from agl_lab.server.store.base import StoreError

SCHEMA_VERSION = 1
_SCHEMA_LOCK = 0x61676C5F  # advisory lock key ("agl_"): two servers starting at once create the tables once

_SCHEMA = """
CREATE TABLE agl_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE agl_rollouts (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- creation order (a re-created id goes last)
    rollout_id TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,                  -- status.updated_at (a lease runs from it)
    active_at DOUBLE PRECISION NOT NULL DEFAULT 0,         -- last heartbeat
    body TEXT NOT NULL                                     -- Rollout as JSON
);
CREATE INDEX agl_rollouts_state ON agl_rollouts (state, seq);
CREATE TABLE agl_events (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- insertion order
    rollout_id TEXT NOT NULL REFERENCES agl_rollouts (rollout_id) ON DELETE CASCADE,
    attempt_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    timestamp DOUBLE PRECISION NOT NULL,
    data BYTEA NOT NULL                                    -- JSON
);
CREATE INDEX agl_events_rollout ON agl_events (rollout_id, seq);
CREATE TABLE agl_models (
    model TEXT NOT NULL, endpoint TEXT NOT NULL, version BIGINT NOT NULL,
    PRIMARY KEY (model, endpoint)
);
CREATE TABLE agl_terminal_head (one BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (one), total BIGINT NOT NULL);
INSERT INTO agl_terminal_head (total) VALUES (0);
CREATE TABLE agl_terminal_log (idx BIGINT PRIMARY KEY, rollout_id TEXT NOT NULL);
CREATE INDEX agl_terminal_log_rollout ON agl_terminal_log (rollout_id, idx);
"""

# Tables added after schema version 1 was released, created where missing (IF NOT EXISTS) on open
_ADDED = """
CREATE TABLE IF NOT EXISTS agl_event_ids (  -- client-made event ids: a resent event is stored once
    rollout_id TEXT NOT NULL REFERENCES agl_rollouts (rollout_id) ON DELETE CASCADE,
    attempt_id TEXT NOT NULL, event_id TEXT NOT NULL, digest TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (rollout_id, attempt_id, event_id)
);
CREATE TABLE IF NOT EXISTS agl_claimers (  -- runners that claimed lately, through any server (fair shares)
    runner_id TEXT PRIMARY KEY, at DOUBLE PRECISION NOT NULL
);
"""


class SchemaMismatch(StoreError, RuntimeError):
    """The database holds agl_lab tables of another schema version."""


def create_or_check_schema(conn: psycopg.Connection[Any], where: str) -> None:
    """Create the tables in an empty database (once, under an advisory lock, however many servers
    start at once), or check the version of the ones there."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
        (found,) = conn.execute("SELECT to_regclass('agl_meta') IS NOT NULL").fetchone()  # type: ignore[misc]
        if not found:
            conn.execute(_SCHEMA)
            conn.execute(_ADDED)
            conn.execute("INSERT INTO agl_meta (key, value) VALUES ('schema_version', %s)", (str(SCHEMA_VERSION),))
            return
        row = conn.execute("SELECT value FROM agl_meta WHERE key = 'schema_version'").fetchone()
        version = None if row is None else row[0]
        if version == str(SCHEMA_VERSION):
            conn.execute(_ADDED)
            _add_digest_column(conn)
    if version != str(SCHEMA_VERSION):
        raise SchemaMismatch(
            f"PostgreSQL store {where} holds agl_lab tables of schema version {version}, this agl_lab reads "
            f"version {SCHEMA_VERSION}: point the `store` setting at another database (or schema: "
            f"?options=-csearch_path%3Dname), or drop the agl_* tables of the old one"
        )


def _add_digest_column(conn: psycopg.Connection[Any]) -> None:
    """`agl_event_ids.digest` where a database made before it lacks it (the ALTER only then: it
    locks the table, and other servers may be appending events)."""
    (found,) = conn.execute(  # type: ignore[misc]
        "SELECT count(*) FROM information_schema.columns WHERE table_schema = current_schema() "
        "AND table_name = 'agl_event_ids' AND column_name = 'digest'"
    ).fetchone()
    if not found:
        conn.execute("ALTER TABLE agl_event_ids ADD COLUMN digest TEXT NOT NULL DEFAULT ''")
