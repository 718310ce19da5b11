"""The store's rooms' fixtures (the session's PostgreSQL and ``pg`` are in tests/conftest.py:
tests of other rooms load a store too)."""
from __future__ import annotations

import os

import pytest


@pytest.fixture
def roles(postgres_server, pg):
    """``roles(kind)``: a new login role of the session's PostgreSQL, its name unique (roles
    belong to the whole server, which other tests share); each dropped after the test, with what
    it owns and every privilege granted to it in ``pg``."""
    import psycopg

    made: list[str] = []

    def make(kind: str) -> str:
        name = f"{kind}_{os.urandom(4).hex()}"
        postgres_server.execute(f"CREATE ROLE {name} LOGIN")
        made.append(name)
        return name

    yield make
    if made:
        with psycopg.connect(pg, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {', '.join(made)} CASCADE")
        for name in made:
            postgres_server.execute(f"DROP ROLE IF EXISTS {name}")
