"""No isolation level a user might configure lets permits over-grant, on MariaDB or PostgreSQL.

A team may run its database at another default level than the engine's own (READ COMMITTED on
PostgreSQL, REPEATABLE READ on InnoDB). The level is set the way an operator would: for the whole
database on PostgreSQL (``ALTER DATABASE ... SET default_transaction_isolation``), for the whole server on
MariaDB (``SET GLOBAL transaction_isolation``), and put back afterwards. Then the many-process test runs:
capacity never exceeded at any instant, tokens unique and in grant order, nothing left held.

It holds at every level because each grant is a conditional write of the semaphore row (``used + n <=
capacity`` re-checked on the row's latest version, or a serialization failure that permits retries),
never a read of a count followed by a write.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL

from tests.concurrency.test_many_processes import run_and_check

LEVELS = ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"]


@contextmanager
def _default_level(url: URL, level: str) -> Iterator[None]:
    """Make ``level`` the default of every new connection to ``url``'s database, then restore it."""
    admin = create_engine(url.set(drivername=_driver(url)), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            if url.get_backend_name() == "postgresql":
                conn.execute(text(f"ALTER DATABASE {url.database} SET default_transaction_isolation = '{level}'"))
            else:
                variable = _level_variable(conn)
                before = conn.execute(text(f"SELECT @@GLOBAL.{variable}")).scalar_one()
                conn.execute(text(f"SET GLOBAL {variable} = '{level.replace(' ', '-')}'"))
        yield
    finally:
        with admin.connect() as conn:
            if url.get_backend_name() == "postgresql":
                conn.execute(text(f"ALTER DATABASE {url.database} RESET default_transaction_isolation"))
            else:
                conn.execute(text(f"SET GLOBAL {variable} = '{before}'"))
        admin.dispose()


def _level_variable(conn: Any) -> str:
    """MariaDB before 11.1 calls it tx_isolation; MySQL 8 only transaction_isolation."""
    version = str(conn.execute(text("SELECT VERSION()")).scalar_one())
    return "tx_isolation" if "MariaDB" in version else "transaction_isolation"


def _driver(url: URL) -> str:
    return "postgresql+psycopg" if url.get_backend_name() == "postgresql" else "mysql+pymysql"


def _level_of_a_new_connection(url: URL) -> str:
    engine = create_engine(url.set(drivername=_driver(url)))
    try:
        with engine.connect() as conn:
            if url.get_backend_name() == "postgresql":
                return str(conn.execute(text("SHOW default_transaction_isolation")).scalar_one()).upper()
            variable = _level_variable(conn)
            return str(conn.execute(text(f"SELECT @@SESSION.{variable}")).scalar_one()).replace("-", " ")
    finally:
        engine.dispose()


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("server", ["mysql", "postgresql"])
def test_no_isolation_level_over_grants(servers: Any, server: str, level: str, ns: str, tmp_path: Path) -> None:
    url = servers.url_for(server)
    with _default_level(url, level):
        assert _level_of_a_new_connection(url) == level
        run_and_check(url.render_as_string(hide_password=False), ns, tmp_path, processes=8, cycles=30)
