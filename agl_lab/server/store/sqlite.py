"""The SQLite store: one file, one server process (`store: sqlite:///path/to/store.db`).

A restarted kernel re-attaches to the file. The semantics are the base class's
(`agl_lab.server.store.base.Store`); this module only implements its storage primitives in SQL,
and holds the file lock that keeps a second store or server off the same file.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from agl_lab.protocol import Event, Model, Rollout, RolloutState
from agl_lab.server.storable import dump_storable
from agl_lab.server.store.base import (
    DEFAULT_TERMINAL_LOG_LIMIT,
    OneProcessStore,
    StoreError,
    StoreLocked,
    load_stored,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- creation order (a re-created id goes last)
    rollout_id TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    body TEXT NOT NULL                       -- Rollout as JSON
);
CREATE INDEX IF NOT EXISTS rollouts_state ON rollouts (state, seq);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,                 -- insertion order (a new row gets max(seq) + 1)
    rollout_id TEXT NOT NULL,
    attempt_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    timestamp REAL NOT NULL,
    data BLOB NOT NULL                       -- JSON (TEXT in files written before 2026-12)
);
CREATE INDEX IF NOT EXISTS events_rollout ON events (rollout_id, attempt_id, seq);
CREATE TABLE IF NOT EXISTS event_ids (        -- client-made event ids (idempotent posts)
    rollout_id TEXT NOT NULL, attempt_id TEXT NOT NULL, event_id TEXT NOT NULL,
    digest TEXT NOT NULL DEFAULT '',         -- base.event_digest of the event ('' in older files)
    PRIMARY KEY (rollout_id, attempt_id, event_id)
);
CREATE TABLE IF NOT EXISTS models (
    model TEXT NOT NULL, endpoint TEXT NOT NULL, version INTEGER NOT NULL,
    PRIMARY KEY (model, endpoint)
);
CREATE TABLE IF NOT EXISTS terminal_log (
    idx INTEGER PRIMARY KEY,                 -- absolute position in the completion order
    rollout_id TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS terminal_log_rollout ON terminal_log (rollout_id, idx);
"""


class SqliteStore(OneProcessStore):
    """One SQLite file (WAL mode); one connection, shared by the threads in turn (the session is a mutex).

    Durability: `synchronous=NORMAL` in WAL mode. Every write, event appends included, is
    committed before the call returns, so an acknowledged write survives a crash of the process
    (a power loss may undo the last ones). A commit in WAL mode with NORMAL does not fsync, so an
    append costs one INSERT and a WAL write. WAL checkpoints run on a background thread's own
    connection (PASSIVE: they never block the server), not inside a model call's commit.

    One store per file: opening takes an exclusive flock on the database file's identity, so a
    symlink or hard link to it is the same file (`_FileLock`; released by `close()` or when the
    process ends, even by kill -9), and a second opener gets StoreLocked.
    Two servers on one file would each hold their own lock and cursor state and meet as
    `database is locked` errors after 5 s busy waits, so it is refused, not supported.
    """

    CHECKPOINT_SECONDS = 1.0
    ROLLOUT_CACHE = 10_000

    def __init__(self, path: str, terminal_log_limit: int = DEFAULT_TERMINAL_LOG_LIMIT):
        super().__init__(terminal_log_limit)
        self.path = path
        self._lock_file: _FileLock | None = None
        if path != ":memory:":
            folder = os.path.dirname(os.path.abspath(path))
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                raise StoreError(
                    f"cannot create the folder {folder} of the SQLite store {path}: {exc.strerror or exc} "
                    "(name a path under a writable folder)"
                ) from None
            if os.path.isdir(path):
                raise StoreError(
                    f"the SQLite store {path} is a directory: name a file, e.g. sqlite:///{path.rstrip('/')}/store.db"
                )
            try:
                self._lock_file = _lock_exclusively(path)
            except OSError as exc:
                raise StoreError(f"cannot open the SQLite store {path}: {exc.strerror or exc}") from None
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes
            self._db.executescript(_SCHEMA)
            if "digest" not in {row[1] for row in self._db.execute("PRAGMA table_info(event_ids)")}:
                self._db.execute("ALTER TABLE event_ids ADD COLUMN digest TEXT NOT NULL DEFAULT ''")  # older files
        except BaseException as exc:
            if self._lock_file is not None:
                self._lock_file.close()
            if isinstance(exc, sqlite3.DatabaseError):  # not a database, a damaged one, a read-only folder
                raise StoreError(
                    f"cannot use {path} as a SQLite store: {exc} (name a new file or an agl_lab store database)"
                ) from None
            raise
        self._cache: dict[str, Rollout] = {}  # rollout_id -> Rollout as stored (see _load)
        self._depth = 0  # nesting of _transaction (re-entrant: one thread at a time holds the session)
        self._closed = threading.Event()
        self._checkpointer: threading.Thread | None = None
        if path != ":memory:":  # an in-memory database has no WAL to checkpoint
            self._db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpoint thread does it
            self._checkpointer = threading.Thread(
                target=self._checkpoint_loop,
                args=(weakref.ref(self), self._closed, path),
                name="agl-sqlite-checkpoint",
                daemon=True,
            )
            self._checkpointer.start()
        with self._session():
            self._terminal_trim()  # a smaller limit on reopen applies at once

    def __repr__(self) -> str:
        return f"SqliteStore({self.path!r})"

    def close(self) -> None:
        with self._session():
            if self._closed.is_set():
                return
            self._closed.set()
        if self._checkpointer is not None and threading.current_thread() is not self._checkpointer:
            self._checkpointer.join(5)
        with self._session():
            self._db.close()
            if self._lock_file is not None:
                self._lock_file.close()  # closing the descriptor releases the flock
                self._lock_file = None

    @staticmethod
    def _checkpoint_loop(ref: weakref.ref, closed: threading.Event, path: str) -> None:
        """The WAL checkpoint thread; holds the store only weakly, so an unclosed store is still freed."""
        checkpointer = sqlite3.connect(path, check_same_thread=False)
        try:
            while not closed.wait(SqliteStore.CHECKPOINT_SECONDS):
                if ref() is None:  # the store was freed without close()
                    return
                with contextlib.suppress(sqlite3.Error):
                    checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            with contextlib.suppress(sqlite3.Error):
                checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")
            checkpointer.close()

    def __del__(self) -> None:
        closed = getattr(self, "_closed", None)
        if closed is not None and not closed.is_set():
            with contextlib.suppress(Exception):
                self.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction: committed, or rolled back and the exception raised (never
        left open). COMMIT is inside the error handling: on a full disk (SQLITE_FULL) it is
        the statement that fails, and what the cache holds from the transaction is then not
        on disk, so the cache is dropped too."""
        if self._depth:  # re-entrant use in the session: the outer call commits
            yield
            return
        if self._db.in_transaction:  # pragma: no cover - only after a failed ROLLBACK
            self._rollback()
        self._depth += 1
        try:
            self._db.execute("BEGIN")
            yield
            self._db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        finally:
            self._depth -= 1

    def _rollback(self) -> None:
        """Undo the open transaction (SQLite may have undone it already) and drop the cache,
        which may hold rows of it; the caller raises the error that caused it."""
        self._cache.clear()
        if self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")

    def _load(self, rollout_id: str) -> Rollout | None:
        # every proxied call reads its rollout: decoded rows are cached (this store is the file's
        # only writer while open), bounded by clearing at ROLLOUT_CACHE entries
        rollout = self._cache.get(rollout_id)
        if rollout is not None:
            return rollout
        row = self._db.execute("SELECT body FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone()
        return None if row is None else self._cached(Rollout.model_validate_json(row[0]))

    def _cached(self, rollout: Rollout) -> Rollout:
        if len(self._cache) >= self.ROLLOUT_CACHE:
            self._cache.clear()
        self._cache[rollout.rollout_id] = rollout
        return rollout

    def _load_many(self, rollout_ids: Sequence[str]) -> dict[str, Rollout]:
        out: dict[str, Rollout] = {}
        for chunk in _chunks(list(dict.fromkeys(rollout_ids)), 500):
            marks = ",".join("?" * len(chunk))
            sql = f"SELECT rollout_id, body FROM rollouts WHERE rollout_id IN ({marks})"
            for rid, body in self._db.execute(sql, chunk):
                out[rid] = Rollout.model_validate_json(body)
        return out

    def _exists(self, rollout_id: str) -> bool:
        if rollout_id in self._cache:
            return True
        sql = "SELECT 1 FROM rollouts WHERE rollout_id=?"
        return self._db.execute(sql, (rollout_id,)).fetchone() is not None

    def _insert(self, rollout: Rollout) -> None:
        self._db.execute(
            "INSERT INTO rollouts (rollout_id, state, body) VALUES (?, ?, ?)",
            (rollout.rollout_id, rollout.status.state.value, rollout.model_dump_json()),
        )
        self._cached(rollout)

    def _insert_many(self, rollouts: Sequence[Rollout]) -> None:
        self._db.executemany(
            "INSERT INTO rollouts (rollout_id, state, body) VALUES (?, ?, ?)",
            ((r.rollout_id, r.status.state.value, r.model_dump_json()) for r in rollouts),
        )
        for rollout in rollouts:
            self._cached(rollout)

    def _replace(self, rollout: Rollout) -> None:
        self._db.execute(
            "UPDATE rollouts SET state=?, body=? WHERE rollout_id=?",
            (rollout.status.state.value, rollout.model_dump_json(), rollout.rollout_id),
        )
        self._cached(rollout)

    def _remove(self, rollout_id: str) -> None:
        self._cache.pop(rollout_id, None)
        self._db.execute("DELETE FROM rollouts WHERE rollout_id=?", (rollout_id,))
        self._db.execute("DELETE FROM events WHERE rollout_id=?", (rollout_id,))
        self._db.execute("DELETE FROM event_ids WHERE rollout_id=?", (rollout_id,))

    def _list(self, states: list[RolloutState], limit: int) -> list[Rollout]:
        marks = ",".join("?" * len(states))
        sql = f"SELECT body FROM rollouts WHERE state IN ({marks}) ORDER BY seq LIMIT ?"
        rows = self._db.execute(sql, [s.value for s in states] + [limit])
        return [Rollout.model_validate_json(body) for (body,) in rows]

    def _count_queued(self) -> int:
        (n,) = self._db.execute("SELECT count(*) FROM rollouts WHERE state = 'queuing'").fetchone()
        return int(n)

    def _lock_queued(self, limit: int) -> list[Rollout]:
        # the session (a mutex) plus the file's flock: no other connection can write these rows
        return self._list([RolloutState.QUEUING], limit)

    def _check_event_data(self, data: dict[str, Any] | None) -> None:
        pass  # `_append_event` encodes with dump_storable, which is the check

    def _append_event(self, event: Event, event_id: str | None = None, digest: str = "") -> str | None:
        # the hot path of every model call: one autocommitted INSERT (the rollout check hits the
        # cache); dump_storable is also the write-time check that the data can be read back
        if not self._exists(event.rollout_id):
            return None
        row = (event.rollout_id, event.attempt_id, event.event_type, event.timestamp, dump_storable(event.data, "data"))
        insert = "INSERT INTO events (rollout_id, attempt_id, event_type, timestamp, data) VALUES (?, ?, ?, ?, ?)"
        if event_id is None:
            self._db.execute(insert, row)  # a BLOB: no decode to str and re-encode by sqlite3
            return digest
        key = (event.rollout_id, event.attempt_id, event_id)
        with self._transaction():  # the id and the event: both or neither
            seen = self._db.execute(
                "INSERT OR IGNORE INTO event_ids (rollout_id, attempt_id, event_id, digest) VALUES (?, ?, ?, ?)",
                (*key, digest),
            )
            if seen.rowcount == 1:
                self._db.execute(insert, row)
                return digest
            sql = "SELECT digest FROM event_ids WHERE rollout_id=? AND attempt_id=? AND event_id=?"
            return self._db.execute(sql, key).fetchone()[0]  # a resend: the digest stored first

    def _events(self, rollout_id: str, attempt_id: str) -> list[Event]:
        sql = "SELECT event_type, timestamp, data FROM events WHERE rollout_id=? AND attempt_id=? ORDER BY seq"
        return [
            Event.model_construct(
                event_type=etype,
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                timestamp=ts,
                data=load_stored(data),
            )
            for etype, ts, data in self._db.execute(sql, (rollout_id, attempt_id))
        ]

    def _attempts(self, rollout_id: str) -> list[str]:
        sql = (
            "SELECT attempt_id, MIN(timestamp) AS t, MIN(seq) AS s FROM events "
            "WHERE rollout_id=? GROUP BY attempt_id ORDER BY t, s"
        )
        return [aid for aid, _, _ in self._db.execute(sql, (rollout_id,))]

    def _terminal_append(self, rollout_id: str) -> None:
        total = self._terminal_total()
        self._db.execute("INSERT INTO terminal_log (idx, rollout_id) VALUES (?, ?)", (total, rollout_id))

    def _terminal_trim(self) -> None:
        oldest_kept = self._terminal_total() - self.terminal_log_limit
        if oldest_kept > 0:
            self._db.execute("DELETE FROM terminal_log WHERE idx < ?", (oldest_kept,))

    def _terminal_total(self) -> int:
        (top,) = self._db.execute("SELECT MAX(idx) FROM terminal_log").fetchone()
        return 0 if top is None else top + 1  # the newest entry is never trimmed

    def _terminal_len(self) -> int:
        (n,) = self._db.execute("SELECT COUNT(*) FROM terminal_log").fetchone()
        return n

    def _terminal_slice(self, start: int, stop: int) -> list[str]:
        sql = (  # "" for an entry superseded by a later entry of the same id
            "SELECT CASE WHEN idx = (SELECT MAX(idx) FROM terminal_log l WHERE l.rollout_id = t.rollout_id) "
            "THEN rollout_id ELSE '' END FROM terminal_log t WHERE idx >= ? AND idx < ? ORDER BY idx"
        )
        return [rid for (rid,) in self._db.execute(sql, (start, stop))]

    def _put_model(self, model: Model) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO models (model, endpoint, version) VALUES (?, ?, ?)",
            (model.model, model.endpoint, model.version),
        )

    def _clear_models(self, model_name: str | None) -> None:
        if model_name is None:
            self._db.execute("DELETE FROM models")
        else:
            self._db.execute("DELETE FROM models WHERE model = ?", (model_name,))

    def _models(self, model_name: str) -> list[Model]:
        sql = "SELECT model, endpoint, version FROM models WHERE model=?"
        return [Model(model=m, endpoint=e, version=v) for m, e, v in self._db.execute(sql, (model_name,))]


_HELD: set[tuple[int, int]] = set()  # (st_dev, st_ino) of the SQLite files this process's stores hold
_HELD_LOCK = threading.Lock()


class _FileLock:
    """An exclusive flock on the database file itself, plus the holder's pid in `<realpath>.lock`.

    The lock is on the file's identity (its inode), not on a name: a symlink or a hard link to
    the file is the same file. A second store in this process is refused by `_HELD` before the
    file is opened again, because closing a second descriptor of the file would drop the
    POSIX locks SQLite holds on it in this process.
    """

    def __init__(self, fd: int, ident: tuple[int, int]):
        self.fd, self.ident = fd, ident

    def close(self) -> None:
        with _HELD_LOCK:
            _HELD.discard(self.ident)
            os.close(self.fd)  # releases the flock


def _lock_exclusively(path: str) -> _FileLock | None:
    """Flock the database file (created if missing) exclusively; StoreLocked if another store
    holds it, through whatever name (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return None
    real = os.path.realpath(path)
    with _HELD_LOCK:
        with contextlib.suppress(FileNotFoundError):
            stat = os.stat(real)
            if (stat.st_dev, stat.st_ino) in _HELD:
                raise _locked(path, real, str(os.getpid()))
        fd = os.open(real, os.O_RDWR | os.O_CREAT, 0o644)
        stat = os.fstat(fd)
        ident = (stat.st_dev, stat.st_ino)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # no SQLite connection of this process is on the file (`_HELD`)
            raise _locked(path, real, _read_pid(real + ".lock")) from None
        _HELD.add(ident)
    with contextlib.suppress(OSError), open(real + ".lock", "w") as pid_file:  # for the refusal message
        pid_file.write(str(os.getpid()))
    return _FileLock(fd, ident)


def _read_pid(pid_path: str) -> str:
    try:
        with open(pid_path) as pid_file:
            return pid_file.read().strip() or "unknown"
    except OSError:
        return "unknown"


def _locked(path: str, real: str, holder: str) -> StoreLocked:
    same = "" if os.path.abspath(path) == real else f" (the file {real!r})"
    return StoreLocked(
        f"SQLite store {path!r}{same} is already open in another store or server process (pid {holder}); "
        f"stop that server, or give this one its own file (store: sqlite:///other.db)"
    )


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
