"""The SQLite store's writes are all or nothing, and one file has one server.

- On a full disk (a small tmpfs mounted by the test) every write is either committed or refused,
  and what the server reads back is what is on disk — during the outage and after a restart.
- A batch create is one transaction: a server killed in the middle of one stores none of it.
- Two stores on one file through a symlink or a hard link: the second is refused.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agl_lab.server.backends import open_store
from agl_lab.server.embedded import EmbeddedServer
from agl_lab.server.store import StoreLocked

KEY = "integrity-key"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted at a fresh directory (skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root: the full-disk test runs only as root")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}): needs CAP_SYS_ADMIN")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(disk: Path) -> Path:
    """Write a file until the filesystem has no byte left; returns it (delete it to free the disk)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 1 << 12, 1):
            while True:
                try:
                    if os.write(fd, b"\0" * size) < size:
                        break
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    return filler


def _on_disk(db: Path) -> tuple[dict[str, str], int]:
    """What another connection reads from the file: {rollout_id: state}, number of events."""
    with sqlite3.connect(db) as side:
        states = dict(side.execute("SELECT rollout_id, state FROM rollouts"))
        (events,) = side.execute("SELECT COUNT(*) FROM events").fetchone()
    return states, events


def test_on_a_full_disk_every_write_is_committed_or_refused(small_disk):
    db = small_disk / "store.db"
    server = EmbeddedServer(key=KEY, store=f"sqlite:///{db}", lease_seconds=0)
    big = "x" * 200_000  # needs WAL pages a full disk cannot give
    try:
        with httpx.Client(base_url=server.url, headers={"x-api-key": KEY}, trust_env=False, timeout=30) as c:
            assert c.post("/api/rollouts", json=[{"rollout_id": "kept", "input": {}}]).status_code == 201
            assert c.patch("/api/rollouts/kept", json={"status": {"state": "running"}}).status_code == 200
            assert c.post("/api/rollouts/kept/attempt/0/events", json={"event_type": "e"}).status_code == 200
            with sqlite3.connect(db) as side:  # empty the WAL, so every new write needs new disk space
                assert side.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
            filler = _fill(small_disk)

            for _ in range(2):  # a retried create is refused the same way
                refused = c.post("/api/rollouts", json=[{"rollout_id": "lost", "input": {"big": big}}])
                assert refused.status_code == 507 and "nothing was stored" in refused.json()["detail"]
                assert c.get("/api/rollouts/lost").status_code == 404
            event = c.post("/api/rollouts/kept/attempt/0/events", json={"event_type": "e", "data": {"big": big}})
            assert event.status_code == 507
            assert c.patch("/api/rollouts/kept", json={"status": {"state": "succeeded"}}).status_code == 507
            assert c.get("/api/rollouts/kept").json()["rollout"]["status"]["state"] == "running"
            assert len(c.get("/api/rollouts/kept/events").json()) == 1
            assert c.get("/api/rollouts/terminal").json()["items"] == []
            assert _on_disk(db) == ({"kept": "running"}, 1)

            filler.unlink()  # space again: the same writes now commit
            assert c.post("/api/rollouts", json=[{"rollout_id": "lost", "input": {"big": big}}]).status_code == 201
            assert c.post("/api/rollouts/lost/attempt/0/events", json={"event_type": "e"}).status_code == 200
            assert c.patch("/api/rollouts/kept", json={"status": {"state": "succeeded"}}).status_code == 200
    finally:
        server.stop()
    assert _on_disk(db) == ({"kept": "succeeded", "lost": "queuing"}, 2)
    store = open_store(f"sqlite:///{db}")  # a restarted server reads what was acknowledged
    try:
        assert store.get_rollout("lost").input == {"big": big}
        assert [i.rollout_id for i in store.terminal_page().items] == ["kept"]
    finally:
        store.close()


def test_a_full_disk_refuses_a_batch_whole(small_disk):
    db = small_disk / "store.db"
    store = open_store(f"sqlite:///{db}")
    try:
        from agl_lab.protocol import RolloutCreate

        batch = [RolloutCreate(rollout_id=f"r{i}", input={"pad": "p" * 2000}) for i in range(3000)]  # ~6 MB > 4 MiB
        with pytest.raises(sqlite3.OperationalError, match="full"):
            store.create_rollouts(batch)
        assert store.list_rollouts(["queuing"], limit=10_000) == []
        assert store.get_rollout("r0") is None
    finally:
        store.close()
    assert _on_disk(db) == ({}, 0)


_KILLED_MID_BATCH = textwrap.dedent("""
    import os, signal, sys
    from agl_lab.protocol import RolloutCreate
    from agl_lab.server.store import SqliteStore

    class Killed(SqliteStore):
        def _cached(self, rollout):  # called once per inserted row: die at row 2,500 of 10,000
            self.rows = getattr(self, "rows", 0) + 1
            if self.rows == 2500:
                os.kill(os.getpid(), signal.SIGKILL)
            return super()._cached(rollout)

    Killed(sys.argv[1]).create_rollouts([RolloutCreate(rollout_id=f"r{i}", input={"i": i}) for i in range(10_000)])
""")


def test_a_server_killed_mid_batch_stores_none_of_it(tmp_path):
    db = tmp_path / "store.db"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_BATCH, str(db)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr
    store = open_store(f"sqlite:///{db}")  # the dead process's lock is gone with it
    try:
        assert store.list_rollouts(["queuing"], limit=10_000) == []
    finally:
        store.close()


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_one_file_through_a_link_is_one_store(tmp_path, link):
    db = tmp_path / "store.db"
    first = open_store(f"sqlite:///{db}")
    try:
        other = tmp_path / "elsewhere"
        other.mkdir()
        alias = other / "alias.db"
        os.symlink(db, alias) if link == "symlink" else os.link(db, alias)
        with pytest.raises(StoreLocked, match="already open"):
            open_store(f"sqlite:///{alias}")
        code = f"from agl_lab.server.backends import open_store; open_store({f'sqlite:///{alias}'!r})"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and "StoreLocked" in proc.stderr and "already open" in proc.stderr
        if link == "symlink":  # the holder's pid is beside the resolved name (a hard link has its own name)
            assert f"pid {os.getpid()}" in proc.stderr
    finally:
        first.close()
    open_store(f"sqlite:///{alias}").close()  # closed: free through either name
