"""Leases on the database's clock (issue 40 item 3): servers whose clocks differ share one ledger.

Two `PostgresStore`s on one real PostgreSQL database stand for two server hosts; each is given a
wall clock 30 s off the true one (`wall_clock=`, the injectable clock), one ahead and one behind.
Heartbeats and events through the one behind keep the rollout alive for the sweeper of the one
ahead (before, a 30 s skew either way re-queued live rollouts at every sweep); silence still
expires the lease. A server whose clock is off the database's by more than a tenth of the lease
warns at start.
"""

from __future__ import annotations

import logging
import time

from agl_lab.protocol import RolloutCreate
from agl_lab.server.app import create_app
from agl_lab.server.store.postgresql import PostgresStore

SKEW = 30.0
LEASE = 2.0


def test_skewed_servers_keep_live_rollouts_and_expire_silent_ones(postgres_database):
    ahead = PostgresStore(postgres_database, wall_clock=lambda: time.time() + SKEW)
    behind = PostgresStore(postgres_database, wall_clock=lambda: time.time() - SKEW)
    try:
        assert abs(ahead.clock_skew_seconds + SKEW) < 5 and abs(behind.clock_skew_seconds - SKEW) < 5
        ahead.create_rollouts([RolloutCreate(rollout_id="hb", input={}), RolloutCreate(rollout_id="ev", input={})])
        assert {r.rollout_id for r in ahead.claim_rollouts(2, "runner-a")} == {"hb", "ev"}
        deadline = time.monotonic() + 3 * LEASE  # longer than the lease: alive only if renewals count
        while time.monotonic() < deadline:
            assert behind.heartbeat(["hb"]) == []  # the host behind renews one lease by heartbeats
            behind.append_event("ev", "0", "step", {})  # and the other by its events
            for sweeper in (ahead, behind):
                assert sweeper.expire_leases(LEASE, max_attempts=2) == {}
            time.sleep(LEASE / 8)
        assert {r.status.state for r in ahead.list_rollouts(["running"])} == {"running"}

        time.sleep(LEASE * 1.5)  # silence: the lease runs out on either sweeper
        assert ahead.expire_leases(LEASE, max_attempts=2) == {"hb": "requeued", "ev": "requeued"}
    finally:
        ahead.close()
        behind.close()


def test_a_server_whose_clock_is_off_the_databases_warns_at_start(postgres_database, caplog):
    fine = PostgresStore(postgres_database)
    skewed = PostgresStore(postgres_database, wall_clock=lambda: time.time() + SKEW)
    try:
        with caplog.at_level(logging.WARNING, logger="agl_lab.server"):
            create_app({"key": "k", "lease_seconds": 60}, store=fine)
            assert "clock" not in caplog.text
            create_app({"key": "k", "lease_seconds": 60}, store=skewed)
        assert "this host's clock is 30" in caplog.text and "ahead of the database's" in caplog.text
        assert "lease_seconds=60" in caplog.text and "NTP" in caplog.text
    finally:
        fine.close()
        skewed.close()
