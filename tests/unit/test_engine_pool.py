"""The two places where the stores lean on SQLAlchemy's pool beyond its documented API
(``stores/_engine.py``): a QueuePool's overflow, read as ``_max_overflow`` to tell a full pool, and
``Pool._invalidate``, which a lost link calls to have the pool's older connections replaced. Each is
checked here on a real pool of a real server, so that a SQLAlchemy release that moves either fails here
rather than quietly changing what the stores do (a pool never seen full parks connections it needs)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.pool import NullPool

from permits.stores._engine import pool_full, sync_check_out_alone, sync_drop_link, sync_live
from tests.conftest import _Servers, sqlalchemy_url


@pytest.fixture
def pg_url(servers: _Servers) -> str:
    return sqlalchemy_url(servers.url_for("postgresql").render_as_string(hide_password=False))


def test_a_queue_pool_is_full_once_its_size_and_overflow_are_checked_out(pg_url: str) -> None:
    engine = create_engine(pg_url, pool_size=1, max_overflow=1)
    try:
        with engine.connect():
            assert not pool_full(engine.pool)
            with engine.connect():
                assert pool_full(engine.pool)
            assert not pool_full(engine.pool)
    finally:
        engine.dispose()


def test_a_pool_without_a_limit_is_never_full(pg_url: str) -> None:
    for engine in (create_engine(pg_url, pool_size=1, max_overflow=-1), create_engine(pg_url, poolclass=NullPool)):
        try:
            with engine.connect(), engine.connect():
                assert not pool_full(engine.pool)
        finally:
            engine.dispose()


def test_a_dropped_link_has_the_pools_older_connections_replaced(pg_url: str) -> None:
    engine = create_engine(pg_url, pool_size=2, max_overflow=0)
    made: list[object] = []
    event.listen(engine, "connect", lambda dbapi_conn, _record: made.append(dbapi_conn))
    try:
        with engine.connect() as first, engine.connect():
            first.execute(text("SELECT 1"))  # both made, and back in the pool at the block's end
        assert len(made) == 2
        lost = sync_check_out_alone(engine)  # as the store's statements that run alone hold one
        sync_drop_link(engine, lost, ConnectionError("the link is gone"))
        assert not sync_live(lost)
        lost.close()
        with engine.connect() as one, engine.connect() as other:
            one.execute(text("SELECT 1"))
            other.execute(text("SELECT 1"))
        # Two new: the lost one's, and the one that stayed in the pool, made before the link was lost
        # (without Pool._invalidate, that one would be used again as it is: three).
        assert len(made) == 4
    finally:
        engine.dispose()
