"""Shared fixtures: real servers on loopback (no mocks).

- `store_url`       parametrised: "memory" and a fresh "sqlite:///…" file (runs a test on both backends;
                    AGL_LAB_TEST_STORES=memory,sqlite,postgresql adds PostgreSQL)
- `every_store_url` the same plus a fresh "postgresql://…" database (`postgres_database`)
- `postgres`        one real PostgreSQL server for the session (tests/postgres.py), skipped where not installed
- `embedded_server` factory: `embedded_server(**ServerConfig overrides) -> EmbeddedServer`, stopped at teardown
- `fake_upstream`   a FakeOpenAI (tests/fakes.py) on a loopback port, reset before each test
- `model`           the tiny model (tests/test_tiny.py builds it), loaded once per test module, on CPU
- `one_thread`      torch at one intra-op thread for the test: small-model forwards are latency-bound,
                    and the engine's decode loop runs the tiny model on one thread (scheduler.py)
- `scaled(seconds)` a test's wait, lease or limit times AGL_LAB_TEST_TIME_SCALE (a float, default 1):
                    set it above 1 on a slow or busy machine (docs/setup.md)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agl_lab.server.embedded import EmbeddedServer
from tests.fakes import FakeOpenAI
from tests.postgres import PostgresCluster
from tests.timescale import TIME_SCALE, scale_timeouts, scaled  # noqa: F401 (tests import scaled from here)


def _store_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if request.param == "memory":
        return "memory"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/store.db"
    return request.getfixturevalue("postgres_database")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    scale_timeouts(config, items)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Name the threads a test left running: a thread still inside torch while the interpreter
    exits can crash it after every test passed (./lab test runs pytest under -X faulthandler, so such a
    crash prints every thread's stack)."""
    import sys
    import threading

    left = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if left:
        names = ", ".join(f"{t.name}{' (daemon)' if t.daemon else ''}" for t in left)
        print(f"[conftest] {len(left)} thread(s) still running at exit: {names}", file=sys.stderr)


# the backends of `store_url` (AGL_LAB_TEST_STORES=memory,sqlite,postgresql runs the server, gateway
# and runner tests on PostgreSQL too: they pass there, ~1.5 min more)
STORE_BACKENDS = os.environ.get("AGL_LAB_TEST_STORES", "memory,sqlite").split(",")


@pytest.fixture(params=STORE_BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    return _store_url(request, tmp_path)


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def every_store_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """`store_url` with PostgreSQL too: the store's own tests (tests/test_store*.py) override
    `store_url` with it, so they run on every backend."""
    return _store_url(request, tmp_path)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresCluster]:
    """One PostgreSQL server for the session (tests/postgres.py); skipped where it is not installed."""
    cluster = PostgresCluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def postgres_database(postgres: PostgresCluster) -> Iterator[str]:
    """The URL of a fresh, empty database, dropped after the test."""
    url = postgres.create_database()
    yield url
    postgres.drop_database(url)


@pytest.fixture
def embedded_server() -> Iterator[Callable[..., EmbeddedServer]]:
    started: list[EmbeddedServer] = []

    def make(config: Any = None, **overrides: Any) -> EmbeddedServer:
        server = EmbeddedServer(config, **overrides)
        started.append(server)
        return server

    yield make
    for server in reversed(started):
        server.stop()


@pytest.fixture(scope="session")
def _fake_upstream_server() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    fake.serve()
    yield fake
    fake.stop()


@pytest.fixture
def fake_upstream(_fake_upstream_server: FakeOpenAI) -> Iterator[FakeOpenAI]:
    _fake_upstream_server.reset()
    yield _fake_upstream_server
    _fake_upstream_server.reset()


@pytest.fixture(scope="module")
def model() -> Any:
    from agl_lab.engines.tiny import load_model_and_tokenizer

    return load_model_and_tokenizer(device="cpu")[0]


@pytest.fixture
def one_thread() -> Iterator[None]:
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
