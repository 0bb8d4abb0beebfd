"""A real PostgreSQL server for the tests: `initdb` into a temp dir, `pg_ctl start` on a Unix socket.

    cluster = PostgresCluster.start()     # ~0.5 s; skips the test where PostgreSQL is not installed
    url = cluster.create_database()      # a fresh, empty database: postgresql://postgres@/t_3?host=...
    cluster.drop_database(url)
    cluster.stop()                       # pg_ctl stop -m immediate, and the directory is removed

Only a Unix socket in the cluster's own directory (no TCP port): clusters of parallel test runs
on one machine cannot collide, and nothing else can reach them. Authentication is `trust`.

Test settings: `fsync=off` and `full_page_writes=off` (start-up and commits are fast; they only
matter for an OS crash or a power loss, which no test makes). `synchronous_commit` stays on, so a
commit is acknowledged after its WAL is written to the kernel: a killed server process (agl_lab's
or PostgreSQL's) loses nothing acknowledged. The kill -9 test turns fsync on anyway
(`durable()`), to run as production does.

initdb refuses to run as root: as root the cluster runs as the `postgres` user (present where the
PostgreSQL packages are installed), in a directory it owns.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

PORT = 5432  # names the socket file only (listen_addresses is empty)


class PostgresCluster:
    def __init__(self, root: str, user: dict[str, Any]):
        self.root, self._user = root, user
        self.data, self.socket_dir = os.path.join(root, "data"), root
        self._names = itertools.count()

    @classmethod
    def start(cls) -> PostgresCluster:
        """initdb + pg_ctl start; pytest.skip (with the reason) where it cannot run here."""
        for tool in ("initdb", "pg_ctl"):
            if shutil.which(tool) is None:
                pytest.skip(
                    f"PostgreSQL is not installed ({tool} is not on PATH): the postgresql store "
                    "tests need PostgreSQL's server binaries (apt-get install postgresql)"
                )
        user: dict[str, Any] = {}
        # /tmp, not $TMPDIR: a short path (a Unix socket path has ~100 bytes) the postgres user can reach
        root = tempfile.mkdtemp(prefix="agl-pg-", dir="/tmp" if os.path.isdir("/tmp") else None)
        if os.geteuid() == 0:  # initdb refuses root
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                shutil.rmtree(root)
                pytest.skip("running as root and there is no `postgres` user to run PostgreSQL as")
            user = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
            os.chown(root, pw.pw_uid, pw.pw_gid)
        cluster = cls(root, user)
        try:
            cluster._run(
                "initdb",
                "-D",
                cluster.data,
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
            )
            # in postgresql.conf, not on the command line, so that ALTER SYSTEM (durable()) can override them
            with open(os.path.join(cluster.data, "postgresql.conf"), "a") as conf:
                conf.write(
                    f"listen_addresses = ''\nunix_socket_directories = '{root}'\nport = {PORT}\n"
                    "fsync = off\nfull_page_writes = off\nmax_connections = 300\n"
                )
            cluster._run("pg_ctl", "-D", cluster.data, "-l", os.path.join(root, "log"), "-w", "-t", "60", "start")
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _run(self, *cmd: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=self.root, **self._user)
        if done.returncode:
            log = os.path.join(self.root, "log")
            tail = open(log).read()[-2000:] if os.path.exists(log) else ""
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stdout}{done.stderr}{tail}")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@/{dbname}?host={self.socket_dir}&port={PORT}"

    def admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url(), autocommit=True)

    def create_database(self) -> str:
        name = f"t_{next(self._names)}"
        with self.admin() as conn:
            conn.execute(f"CREATE DATABASE {name} STRATEGY FILE_COPY")
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = url.split("/")[3].split("?")[0]
        with self.admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    @contextlib.contextmanager
    def durable(self) -> Iterator[None]:
        """fsync on (production's setting) for the duration, then back off."""
        with self.admin() as conn:
            conn.execute("ALTER SYSTEM SET fsync = on")
            conn.execute("SELECT pg_reload_conf()")
        try:
            yield
        finally:
            with self.admin() as conn:
                conn.execute("ALTER SYSTEM RESET fsync")
                conn.execute("SELECT pg_reload_conf()")

    def stop(self) -> None:
        if os.path.exists(os.path.join(self.data, "postmaster.pid")):
            with contextlib.suppress(RuntimeError):
                self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
