"""The PostgreSQL store: one ledger that several server processes (on several hosts) share.

    open_store("postgresql://user:pass@host:5432/db")  -> PostgresStore   (agl_lab.server.backends)

The semantics are the base class's (`agl_lab.server.store.base.Store`), unchanged; this module only
implements its primitives in SQL and replaces the two things a store one process owns keeps in that
process (`base.OneProcessStore`):

- **The session.** The base class runs every public method in `with self._session()` and does
  read-modify-write (`_load`, then `_replace`). A process-local mutex says nothing about another
  server process, so here the session is `_ConnectionSession`: entering it binds one pooled
  connection to the calling thread (re-entrant), and excludes nothing. What makes a transition
  exactly-once is the database: `_transaction()` is a real transaction, and inside one `_load` reads
  the row `FOR NO KEY UPDATE`, so of two processes moving one rollout queuing -> running the second
  waits for the first's COMMIT, then reads `running` and gets InvalidTransition (409).
  (`NO KEY UPDATE`, not `UPDATE`: an event insert's foreign-key check takes `KEY SHARE` on the
  rollout row, which `NO KEY UPDATE` lets through, so a PATCH never queues behind model calls.)
- **Per-process memory.** `models_for` keeps a pool `models_ttl_seconds` (1 s; the base class's
  cache, kept until this process's next model write, would serve a stale pool after another process
  registered endpoints for ever), and lease activity is stored, not kept in memory: a heartbeat
  writes `active_at`, an event is its own timestamp (the newest event row), so a server that never
  saw a runner's heartbeat still knows its lease is alive (`_touch`, `_idle_running`).

How each primitive is done:

    _load / _load_many   SELECT body (in a write transaction: `FOR NO KEY UPDATE` / advisory
                         locks on the ids, so two creators of one client id run one after the other
                         and the second returns the first's rollout)
    _insert_many         one INSERT of all rows; `seq` (an identity column) is creation order
    _append_event        INSERT ... WHERE EXISTS (the rollout); the foreign key (ON DELETE
                         CASCADE) closes the race with a concurrent DELETE; autocommitted
    terminal log         `agl_terminal_head` holds the absolute count; an append is
                         `UPDATE head SET total = total + 1 RETURNING` + INSERT, in the PATCH's
                         transaction. The head's row lock, held to COMMIT, makes the log gap-free and
                         in commit order: index i+1 cannot be taken before i is committed, so a
                         reader never sees i+1 without i and a cursor never skips a slow commit. (A
                         SEQUENCE would not do: its numbers are handed out at INSERT, not COMMIT,
                         so a reader could pass an index whose transaction commits later.)
    terminal_page        all of its reads in one REPEATABLE READ snapshot
    leases               `_touch` (heartbeat) / `_idle_running` (the sweep) / `_lock_queued`
                         (batch claim, `FOR NO KEY UPDATE SKIP LOCKED`), see their docstrings

Durability: every write is committed before the call returns, with the server's
`synchronous_commit` (default on: the WAL is flushed), so an acknowledged write survives kill -9 of
any agl_lab server process, and of a PostgreSQL process (crash recovery replays the WAL).

Timeouts: a call waits at most `pool_timeout` (the server's `store_timeout_seconds`, 2 s) for a
connection, then raises StoreUnavailable (503); the app runs every store call in a worker thread, so
a database outage stalls no event loop and concurrent calls wait side by side, not in turn.

Driver: **psycopg 3** (`psycopg[binary]`, `psycopg-pool`). The store's API is synchronous and
called from the app's worker threads; psycopg 3 is a maintained, synchronous-first driver with a thread-safe connection pool,
binary wheels and server-side prepared statements. asyncpg is async-only: each call would hop to a
private event loop thread and back (`run_coroutine_threadsafe`), adding a thread switch and a
second loop to every store call for no gain here.

Tables (`agl_` prefixed, in the connection's first `search_path` schema, so one database can hold
several stores: add `?options=-csearch_path%3Drun7` to the URL for a schema of its own): see
`pg_schema.py`. What servers on several hosts coordinate through the database (one clock, fair
claims, wake-ups) is `pg_servers.py`, a mixin of `PostgresStore`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import orjson
import psycopg
import psycopg.conninfo
import psycopg.errors
import psycopg_pool

from agl_lab.protocol import Event, Model, Rollout, RolloutState, TerminalPage
from agl_lab.server.storable import dump_storable
from agl_lab.server.store.base import (
    DEFAULT_TERMINAL_LOG_LIMIT,
    Store,
    StoreUnavailable,
)
from agl_lab.server.store.pg_schema import SchemaMismatch, create_or_check_schema
from agl_lab.server.store.pg_servers import ServersOfOneDatabase

__all__ = ["PostgresStore", "SchemaMismatch", "redact"]

# A running rollout's newest activity: status change, heartbeat or event *of the running attempt* (not an old one's)
_LAST_ACTIVITY = """GREATEST(r.updated_at, r.active_at, COALESCE(
    (SELECT e.timestamp FROM agl_events e WHERE e.rollout_id = r.rollout_id
       AND e.attempt_id = COALESCE(r.body::json->'status'->>'last_attempt_id', '0')
     ORDER BY e.seq DESC LIMIT 1), 0))"""


def redact(url: str) -> str:
    """`url` without its password (for messages and repr)."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}:***@{host}" if ":" in user else netloc
    query = urllib.parse.urlencode(
        [(k, "***" if k == "password" else v) for k, v in urllib.parse.parse_qsl(parts.query)], safe="/%="
    )
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())  # libpq's messages span lines


class _ConnectionSession:
    """`PostgresStore`'s session: entering binds a pooled connection to the calling thread
    (re-entrant: nested entries reuse it), leaving the outermost entry returns it to the pool.

    It excludes nothing: threads and processes run concurrently, and the database's transactions and
    row locks do the excluding. A connection failure (PostgreSQL down or restarted, pool exhausted)
    leaves as StoreUnavailable, which the app answers 503 (nothing was stored; retry).
    """

    def __init__(self, pool: psycopg_pool.ConnectionPool, where: str):
        self._pool, self._where = pool, where
        self._local = threading.local()

    @property
    def conn(self) -> psycopg.Connection[Any]:
        return self._local.conn

    @property
    def txn(self) -> str | None:
        """None, "write" (inside `_transaction`) or "read" (inside `_snapshot`)."""
        return getattr(self._local, "txn", None)

    @txn.setter
    def txn(self, value: str | None) -> None:
        self._local.txn = value

    def __enter__(self) -> _ConnectionSession:
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth == 0:
            try:
                local.conn = self._pool.getconn()
            except psycopg.OperationalError as exc:  # PoolTimeout is one
                raise self._unavailable(exc) from exc
        local.depth = depth + 1
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        local = self._local
        local.depth -= 1
        if local.depth == 0:
            conn, local.conn = local.conn, None
            self._pool.putconn(conn)  # the pool discards a broken connection
            if isinstance(exc, psycopg.OperationalError):
                if conn.broken:  # PostgreSQL restarted? its other idle connections are dead too: test them
                    with contextlib.suppress(psycopg.Error):
                        self._pool.check()  # now, so that one call fails, not one per pooled connection
                raise self._unavailable(exc) from exc

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        return StoreUnavailable(
            f"PostgreSQL store {self._where} failed: {type(exc).__name__}: {_one_line(exc)} — nothing was "
            f"stored; retry (is PostgreSQL up and reachable? the store URL is the `store` setting / --store)"
        )


class PostgresStore(ServersOfOneDatabase, Store):
    """A `Store` in a PostgreSQL database that any number of server processes, on any hosts, share.

    `url` is a libpq URI (`postgresql://user:pass@host:port/db?sslmode=...`). Opening connects once
    (errors name the URL, without its password, and the fix), creates the tables if the database
    has none, and refuses tables of another schema version. `pool_size` bounds this process's
    connections (each concurrent store call holds one).

    Shared: every server process opens its own `PostgresStore` on the same URL and keeps nothing
    the others need in its memory. Rollouts, events, the terminal log, the model registry, lease
    activity and the runners claiming are all rows; the clock is the database's and wake-ups go
    through NOTIFY (`pg_servers.py`).

    Concurrency, as the code does it:
    - `_session()` (`_ConnectionSession`) hands the calling thread a pooled connection and
      excludes nothing: threads of this process and other processes run side by side.
    - `_transaction()` is a database transaction (READ COMMITTED); inside one, `_load` row-locks
      the rollout it reads (`FOR NO KEY UPDATE`: a second PATCH waits, then sees the first's
      state), `_load_many` takes an advisory lock per id (in sorted order: no deadlock), so two
      creators of one client id or two lease sweeps run one after the other, `_lock_queued` skips
      the rows another claim holds (`SKIP LOCKED`), and the terminal log's head row serialises
      appends in commit order.
    - `_touch` (a heartbeat) row-locks its rollouts in id order; event appends are single
      autocommitted statements (their foreign key closes the race with a DELETE).
    - Reads outside a transaction are autocommitted statements; `terminal_page` reads in one
      REPEATABLE READ snapshot (`_snapshot`).
    """

    TOUCH_ON_EVENT = False  # an event row is its own activity (_LAST_ACTIVITY): no UPDATE per model call

    def __init__(
        self,
        url: str,
        terminal_log_limit: int = DEFAULT_TERMINAL_LOG_LIMIT,
        *,
        pool_size: int = 16,
        connect_timeout: float = 10.0,
        pool_timeout: float = 2.0,
        models_ttl_seconds: float = 1.0,
        wall_clock: Callable[[], float] = time.time,
    ):
        super().__init__(terminal_log_limit)
        if pool_timeout <= 0:
            raise ValueError(f"pool_timeout must be > 0, got {pool_timeout}: set store_timeout_seconds (e.g. 2)")
        self.models_ttl_seconds = float(models_ttl_seconds)
        self._pools_at: dict[str, float] = {}  # model name -> monotonic time its cached pool was read
        self.url = url
        self._where = redact(url)
        try:
            conninfo = psycopg.conninfo.make_conninfo(url, connect_timeout=max(1, round(connect_timeout)))
        except psycopg.ProgrammingError as exc:
            raise ValueError(
                f"store url {self._where!r} is not a PostgreSQL URL ({_one_line(exc)}): use "
                "'postgresql://user:password@host:5432/database'"
            ) from None
        try:
            with psycopg.connect(conninfo, autocommit=True) as conn:
                create_or_check_schema(conn, self._where)
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(
                f"cannot connect to the PostgreSQL store {self._where}: {_one_line(exc)}; start PostgreSQL or "
                f"fix the URL (the `store` setting / --store)"
            ) from None
        self._pool = psycopg_pool.ConnectionPool(
            conninfo,
            min_size=1,
            max_size=pool_size,
            timeout=pool_timeout,  # a call waits this long for a connection, then 503: well below the lease
            open=True,
            kwargs={"autocommit": True},
            name=f"agl-store-{id(self):x}",
        )
        self._connections = _ConnectionSession(self._pool, self._where)
        self._conninfo = conninfo
        self._instance = uuid.uuid4().hex  # names this store's NOTIFYs (`listen_queued` skips its own)
        self._claimers_seen: dict[str, float] = {}  # runner id -> when this process last wrote its row
        self._claimer_count: tuple[float, int] = (-1e18, 0)  # (when read, recent claimers) of agl_claimers
        self._wall_clock = wall_clock
        self.clock_skew_seconds = 0.0  # the database's clock minus this host's (`_db_now`)
        with self._session():
            self._db_now()
        with self._session(), self._transaction():
            self._terminal_trim()  # a smaller limit on open applies at once

    def __repr__(self) -> str:
        return f"PostgresStore({self._where!r})"

    def close(self) -> None:
        self._pool.close()

    # --- transactions -------------------------------------------------------------------------

    def _session(self) -> _ConnectionSession:
        return self._connections

    @property
    def _db(self) -> psycopg.Connection[Any]:
        """The connection this thread's session holds."""
        return self._connections.conn

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction on this thread's connection (re-entrant: the outer one commits);
        rolled back and the error raised on any failure."""
        session = self._connections
        if session.txn is not None:
            yield
            return
        session.txn = "write"
        try:
            with session.conn.transaction():
                yield
        finally:
            session.txn = None

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[None]:
        """A read-only REPEATABLE READ transaction: every read inside sees one committed state."""
        session = self._connections
        with session:
            if session.txn is not None:
                yield
                return
            session.txn = "read"
            try:
                session.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                yield
                session.conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(psycopg.Error):
                    session.conn.execute("ROLLBACK")
                raise
            finally:
                session.txn = None

    def _writing(self) -> bool:
        return self._connections.txn == "write"

    # --- public methods that differ: cross-process state -----------------------------------------

    def terminal_page(self, after: int = 0, limit: int = 1000) -> TerminalPage:
        # Critical: one snapshot for the head, the window and the slice; separate statements could
        # see a trim in between and hand out a cursor that re-reads entries
        with self._snapshot():
            return super().terminal_page(after, limit)

    def models_for(self, model_name: str) -> list[Model]:
        """The endpoints registered for `model_name`, sorted by endpoint string.

        A non-empty answer is kept `models_ttl_seconds` (another server process may register or clear
        endpoints: it is seen that much later; this process's own writes drop the cache at once); an
        empty one is not kept (the first registration is served at once)."""
        now = time.monotonic()
        pool = self._pools.get(model_name)
        if pool is not None and now - self._pools_at.get(model_name, -1e18) < self.models_ttl_seconds:
            return list(pool)
        with self._session():
            pool = tuple(sorted(self._models(model_name), key=lambda m: m.endpoint))
        if pool:
            self._pools[model_name], self._pools_at[model_name] = pool, now
        else:
            self._pools.pop(model_name, None)
        return list(pool)

    # --- lease and claim primitives -----------------------------------------------------------------

    def _touch(self, rollout_ids: Sequence[str], now: float) -> set[str]:
        """Record activity for those of `rollout_ids` that are running, at the database's clock
        (`clock_timestamp()`, whichever host asks; `now` is not used); returns them.

        Rows are locked in id order (two heartbeats over overlapping ids cannot deadlock);
        `active_at` only moves forward.
        """
        rows = self._db.execute(
            "WITH locked AS (SELECT rollout_id FROM agl_rollouts WHERE rollout_id = ANY(%s) AND state = 'running' "
            "ORDER BY rollout_id FOR NO KEY UPDATE) "
            "UPDATE agl_rollouts r SET active_at = GREATEST(r.active_at, extract(epoch FROM clock_timestamp())) "
            "FROM locked WHERE r.rollout_id = locked.rollout_id RETURNING r.rollout_id",
            (list(rollout_ids),),
        )
        return {rid for (rid,) in rows}

    def _idle_running(self, before: float) -> list[str]:
        """Ids of running rollouts whose last activity (status change, heartbeat or event, from any
        process) is older than `before`, in creation order. Reads only: the base class's
        `expire_leases` locks the rows it returns (`_load_many` in its transaction) and asks again,
        so a heartbeat that committed in between keeps its rollout."""
        sql = (
            f"SELECT r.rollout_id FROM agl_rollouts r WHERE r.state = 'running' AND {_LAST_ACTIVITY} < %s "
            "ORDER BY r.seq"
        )
        return [rid for (rid,) in self._db.execute(sql, (before,))]

    def _lock_queued(self, limit: int) -> list[Rollout]:
        """The oldest `limit` queuing rollouts, row-locked for this write transaction.

        `FOR NO KEY UPDATE SKIP LOCKED`: rows another transaction is claiming are skipped, not
        waited for, so concurrent claimers (in any process) get disjoint rollouts at once; the caller
        moves them to running in the same transaction. Must run inside `_transaction()`.
        """
        if not self._writing():
            raise RuntimeError("_lock_queued must run inside _transaction(): the locks end with it")
        sql = (
            "SELECT body FROM agl_rollouts WHERE state = 'queuing' ORDER BY seq LIMIT %s FOR NO KEY UPDATE SKIP LOCKED"
        )
        return [Rollout.model_validate_json(body) for (body,) in self._db.execute(sql, (limit,))]

    # --- rollouts -------------------------------------------------------------------------------

    def _load(self, rollout_id: str) -> Rollout | None:
        if "\x00" in rollout_id:  # no stored id holds NUL (storable.py); PostgreSQL would refuse the query
            return None
        lock = " FOR NO KEY UPDATE" if self._writing() else ""  # the read of a read-modify-write
        row = self._db.execute(f"SELECT body FROM agl_rollouts WHERE rollout_id = %s{lock}", (rollout_id,)).fetchone()
        return None if row is None else Rollout.model_validate_json(row[0])

    def _load_many(self, rollout_ids: Sequence[str]) -> dict[str, Rollout]:
        ids = [rid for rid in dict.fromkeys(rollout_ids) if "\x00" not in rid]  # none stored holds NUL
        if not ids:
            return {}
        if self._writing():  # create_rollouts: a concurrent creator of one of these ids commits first
            self._db.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(id, 0)) FROM unnest(%s::text[]) id", (sorted(ids),)
            )  # sorted: two creators lock in one order (no deadlock)
        rows = self._db.execute("SELECT rollout_id, body FROM agl_rollouts WHERE rollout_id = ANY(%s)", (ids,))
        return {rid: Rollout.model_validate_json(body) for rid, body in rows}

    def _exists(self, rollout_id: str) -> bool:
        if "\x00" in rollout_id:
            return False
        row = self._db.execute("SELECT 1 FROM agl_rollouts WHERE rollout_id = %s", (rollout_id,)).fetchone()
        return row is not None

    def _insert(self, rollout: Rollout) -> None:
        self._insert_many([rollout])

    def _insert_many(self, rollouts: Sequence[Rollout]) -> None:
        if not rollouts:
            return
        self._db.execute(
            "INSERT INTO agl_rollouts (rollout_id, state, updated_at, body) "
            "SELECT a, b, c, d FROM unnest(%s::text[], %s::text[], %s::float8[], %s::text[]) "
            "WITH ORDINALITY AS t(a, b, c, d, n) "
            "ORDER BY n",  # seq follows the batch order
            (
                [r.rollout_id for r in rollouts],
                [r.status.state.value for r in rollouts],
                [r.status.updated_at for r in rollouts],
                [r.model_dump_json() for r in rollouts],
            ),
        )

    def _replace(self, rollout: Rollout) -> None:
        self._db.execute(
            "UPDATE agl_rollouts SET state = %s, updated_at = %s, body = %s WHERE rollout_id = %s",
            (rollout.status.state.value, rollout.status.updated_at, rollout.model_dump_json(), rollout.rollout_id),
        )

    def _remove(self, rollout_id: str) -> None:
        self._db.execute("DELETE FROM agl_rollouts WHERE rollout_id = %s", (rollout_id,))  # events: CASCADE

    def _list(self, states: list[RolloutState], limit: int) -> list[Rollout]:
        rows = self._db.execute(
            "SELECT body FROM agl_rollouts WHERE state = ANY(%s) ORDER BY seq LIMIT %s",
            ([s.value for s in states], min(limit, 2**62)),
        )
        return [Rollout.model_validate_json(body) for (body,) in rows]

    # --- events ---------------------------------------------------------------------------------

    def _check_event_data(self, data: dict[str, Any] | None) -> None:
        pass  # `_append_event` encodes with dump_storable, which is the check

    def _append_event(self, event: Event, event_id: str | None = None, digest: str = "") -> str | None:
        data = dump_storable(event.data, "data")
        row = (event.rollout_id, event.attempt_id, event.event_type, event.timestamp, data, event.rollout_id)
        try:
            if event_id is None:
                cur = self._db.execute(
                    "INSERT INTO agl_events (rollout_id, attempt_id, event_type, timestamp, data) "
                    "SELECT %s, %s, %s, %s, %s WHERE EXISTS (SELECT 1 FROM agl_rollouts WHERE rollout_id = %s)",
                    row,
                )
                return digest if cur.rowcount == 1 else None
            # one statement, the id row and the event row both or neither (a concurrent same-id post waits, adds none)
            key = (event.rollout_id, event.attempt_id, event_id)
            cur = self._db.execute(
                "WITH id AS (INSERT INTO agl_event_ids (rollout_id, attempt_id, event_id, digest) "
                "SELECT %s, %s, %s, %s WHERE EXISTS (SELECT 1 FROM agl_rollouts WHERE rollout_id = %s) "
                "ON CONFLICT DO NOTHING RETURNING 1) "
                "INSERT INTO agl_events (rollout_id, attempt_id, event_type, timestamp, data) "
                "SELECT %s, %s, %s, %s, %s WHERE EXISTS (SELECT 1 FROM id)",
                (*key, digest, event.rollout_id, *row[:5]),
            )
        except psycopg.errors.ForeignKeyViolation:  # deleted between the check and the insert
            return None
        if cur.rowcount == 1:
            return digest
        # 0 rows: a repeated id (its row holds the first post's digest, from any server), or no rollout
        sql = "SELECT digest FROM agl_event_ids WHERE rollout_id = %s AND attempt_id = %s AND event_id = %s"
        stored = self._db.execute(sql, key).fetchone()
        return None if stored is None else stored[0]

    def _events(self, rollout_id: str, attempt_id: str) -> list[Event]:
        if "\x00" in rollout_id + attempt_id:
            return []
        rows = self._db.execute(
            "SELECT event_type, timestamp, data FROM agl_events WHERE rollout_id = %s AND attempt_id = %s ORDER BY seq",
            (rollout_id, attempt_id),
        )
        return [
            Event.model_construct(
                event_type=etype, rollout_id=rollout_id, attempt_id=attempt_id, timestamp=ts, data=orjson.loads(data)
            )
            for etype, ts, data in rows
        ]

    def _attempts(self, rollout_id: str) -> list[str]:
        if "\x00" in rollout_id:
            return []
        rows = self._db.execute(
            "SELECT attempt_id FROM agl_events WHERE rollout_id = %s GROUP BY attempt_id "
            "ORDER BY MIN(timestamp), MIN(seq)",
            (rollout_id,),
        )
        return [aid for (aid,) in rows]

    # --- terminal-order log ---------------------------------------------------------------------

    def _terminal_append(self, rollout_id: str) -> None:
        # Critical: the head's row lock is held until COMMIT, so indices are taken in commit order
        self._db.execute(
            "WITH head AS (UPDATE agl_terminal_head SET total = total + 1 RETURNING total - 1 AS idx) "
            "INSERT INTO agl_terminal_log (idx, rollout_id) SELECT idx, %s FROM head",
            (rollout_id,),
        )

    def _terminal_trim(self) -> None:
        self._db.execute(
            "DELETE FROM agl_terminal_log WHERE idx < (SELECT total FROM agl_terminal_head) - %s",
            (self.terminal_log_limit,),
        )

    def _terminal_total(self) -> int:
        (total,) = self._db.execute("SELECT total FROM agl_terminal_head").fetchone()  # type: ignore[misc]
        return int(total)

    def _terminal_len(self) -> int:
        # the log is gap-free and trimmed from the front: it holds [min(idx), total)
        sql = "SELECT h.total - COALESCE((SELECT MIN(idx) FROM agl_terminal_log), h.total) FROM agl_terminal_head h"
        (n,) = self._db.execute(sql).fetchone()  # type: ignore[misc]
        return int(n)

    def _terminal_slice(self, start: int, stop: int) -> list[str]:
        sql = (  # "" for an entry superseded by a later entry of the same id
            "SELECT CASE WHEN t.idx = (SELECT MAX(l.idx) FROM agl_terminal_log l WHERE l.rollout_id = t.rollout_id) "
            "THEN t.rollout_id ELSE '' END FROM agl_terminal_log t WHERE t.idx >= %s AND t.idx < %s ORDER BY t.idx"
        )
        return [rid for (rid,) in self._db.execute(sql, (start, stop))]

    # --- model registry -------------------------------------------------------------------------

    def _put_model(self, model: Model) -> None:
        self._db.execute(
            "INSERT INTO agl_models (model, endpoint, version) VALUES (%s, %s, %s) "
            "ON CONFLICT (model, endpoint) DO UPDATE SET version = EXCLUDED.version",
            (model.model, model.endpoint, model.version),
        )

    def _clear_models(self, model_name: str | None) -> None:
        if model_name is None:
            self._db.execute("DELETE FROM agl_models")
        elif "\x00" not in model_name:  # no stored name holds NUL (PostgreSQL text cannot)
            self._db.execute("DELETE FROM agl_models WHERE model = %s", (model_name,))

    def _models(self, model_name: str) -> list[Model]:
        if "\x00" in model_name:  # no stored name holds NUL: the answer of memory and SQLite
            return []
        rows = self._db.execute("SELECT model, endpoint, version FROM agl_models WHERE model = %s", (model_name,))
        return [Model(model=m, endpoint=e, version=v) for m, e, v in rows]
