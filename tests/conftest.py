"""Shared fixtures: real servers on loopback (no mocks).

- `store_url`       parametrised: "memory" and a fresh "sqlite:///…" file (runs a test on both backends)
- `embedded_server` factory: `embedded_server(**ServerConfig overrides) -> EmbeddedServer`, stopped at teardown
- `fake_upstream`   a FakeOpenAI (tests/fakes.py) on a loopback port, reset before each test
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agl_lab.server.embedded import EmbeddedServer
from tests.fakes import FakeOpenAI


@pytest.fixture(params=["memory", "sqlite"])
def store_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    return "memory" if request.param == "memory" else f"sqlite:///{tmp_path}/store.db"


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
