"""One real PostgreSQL server for the session (`server.Server`); each test gets its own database."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tests.ledger_pg.server import Server, started

_names = itertools.count()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Server]:
    server = started()
    if server is None:
        pytest.skip("PostgreSQL is not installed (initdb): make install (apt-get postgresql)")
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture
def pg_dsn(pg_server: Server) -> str:
    """A fresh database on the session's server."""
    return pg_server.create(f"record{next(_names)}")
