"""What the servers of one PostgreSQL store coordinate through the database (`PostgresStore`'s mixin).

- **One clock.** Status changes and events are stamped with the database's clock (this host's clock
  plus the offset measured at open and at every lease sweep), heartbeats with `clock_timestamp()`
  in SQL, and the sweep runs against the database's clock: server hosts whose clocks differ agree
  on which leases ran out (`clock_skew_seconds` is what the app warns about at start).
- **Fair claims.** Runners that claimed through any server in the last CLAIMER_WINDOW_SECONDS are
  rows of `agl_claimers`; the base class caps a claim to ceil(queued / claimers).
- **Wake-ups.** A write that queues rollouts sends `NOTIFY agl_queued` (delivered at commit);
  `listen_queued` is how each server's app wakes its waiting claims.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg

from agl_lab.server.store.base import CLAIMER_WINDOW_SECONDS

QUEUED_CHANNEL = "agl_queued"  # NOTIFY'd at the commit of a write that queued rollouts


class ServersOfOneDatabase:
    """Mixin of `PostgresStore` (which provides `_db`, `_session`, `_conninfo`, `_instance`,
    `_wall_clock` and the claimer caches)."""

    _db: Any
    _session: Callable[[], Any]
    _conninfo: str
    _instance: str
    _wall_clock: Callable[[], float]
    _claimers_seen: dict[str, float]
    _claimer_count: tuple[float, int]
    clock_skew_seconds: float

    # --- the clock: the database's, one for every host --------------------------------------------

    def _clock(self) -> float:
        """The database's clock, as this host's clock plus the offset `_db_now` last measured (at open,
        then at every lease sweep): servers on hosts whose clocks differ stamp one time scale."""
        return self._wall_clock() + self.clock_skew_seconds

    def _db_now(self) -> float:
        """The database's clock_timestamp() (seconds since the epoch); refreshes `clock_skew_seconds`
        (the database's clock minus this host's, measured at the query's midpoint). In the session."""
        before = self._wall_clock()
        (db_now,) = self._db.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()  # type: ignore[misc]
        self.clock_skew_seconds = float(db_now) - (before + self._wall_clock()) / 2
        return float(db_now)

    def expire_leases(self, lease_seconds: float, max_attempts: int = 1, now: float | None = None) -> dict[str, str]:
        """The base class's sweep, against the database's clock (read now, not this host's)."""
        if now is None:
            with self._session():
                now = self._db_now()
        return super().expire_leases(lease_seconds, max_attempts, now)

    # --- claims across servers: fair shares, wake-ups ------------------------------------------------

    def _recent_claimers(self, runner_id: str, now: float) -> int:
        """Runners that claimed within CLAIMER_WINDOW_SECONDS through any server of this database.

        Cheap for idle pollers: a runner's row is written at most every quarter window by this
        process, and the count is read at most once a second."""
        if runner_id and self._claimers_seen.get(runner_id, -1e18) < now - CLAIMER_WINDOW_SECONDS / 4:
            self._db.execute(
                "INSERT INTO agl_claimers (runner_id, at) VALUES (%s, %s) "
                "ON CONFLICT (runner_id) DO UPDATE SET at = GREATEST(agl_claimers.at, EXCLUDED.at)",
                (runner_id, now),
            )
            self._claimers_seen[runner_id] = now
            self._claimer_count = (-1e18, 0)  # a new claimer: count again
            if len(self._claimers_seen) > 4096:
                self._claimers_seen = {r: at for r, at in self._claimers_seen.items() if at > now - 60}
        read_at, count = self._claimer_count
        if now - read_at > 1.0:
            (count,) = self._db.execute(  # type: ignore[misc]
                "SELECT count(*) FROM agl_claimers WHERE at > %s", (now - CLAIMER_WINDOW_SECONDS,)
            ).fetchone()
            self._claimer_count = (now, int(count))
            if count > 4 * len(self._claimers_seen) + 64:  # old rows: forget them (any server may)
                self._db.execute("DELETE FROM agl_claimers WHERE at < %s", (now - 10 * CLAIMER_WINDOW_SECONDS,))
        return max(1, int(count) + (0 if runner_id else 1))

    def _count_queued(self) -> int:
        (n,) = self._db.execute("SELECT count(*) FROM agl_rollouts WHERE state = 'queuing'").fetchone()  # type: ignore[misc]
        return int(n)

    def _notify_queued(self) -> None:
        # delivered at COMMIT to every listener (one per transaction: PostgreSQL folds repeats)
        self._db.execute("SELECT pg_notify(%s, %s)", (QUEUED_CHANNEL, self._instance))

    def listen_queued(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` (in a thread of its own) whenever any store instance (any server, this one
        too: a trainer may write through the store object, not the app) of this database queued
        rollouts, after the write's commit (LISTEN on QUEUED_CHANNEL; also once after each
        (re)connect: notifications sent while it was away are lost). Returns `stop()`."""
        stop = threading.Event()

        def listen() -> None:
            while not stop.is_set():
                try:
                    with psycopg.connect(self._conninfo, autocommit=True) as conn:
                        conn.execute(f"LISTEN {QUEUED_CHANNEL}")
                        callback()
                        while not stop.is_set():
                            for _ in conn.notifies(timeout=1.0, stop_after=1):
                                callback()
                except psycopg.Error:
                    stop.wait(1.0)  # PostgreSQL away: the claims' periodic re-check covers it meanwhile

        thread = threading.Thread(target=listen, name="agl-store-listen", daemon=True)
        thread.start()

        def stop_listening() -> None:
            stop.set()
            thread.join(10)

        return stop_listening
