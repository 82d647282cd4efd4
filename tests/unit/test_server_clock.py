"""The testing-only server clock (``permits.dialects.server_clock``) never reaches production SQL, and
inside the tests moves every reading of a server's clock, so that no statement runs on the real one."""

from __future__ import annotations

import pytest

from permits.dialects import server_clock
from permits.dialects.base import Dialect
from permits.dialects.mysql import MariaDB, MariaDBCluster, MySQL, MySQLCluster
from permits.dialects.postgresql import PostgreSQL
from permits.dialects.sqlite import SQLite

SERVERS: list[type[Dialect]] = [MariaDB, MySQL, MariaDBCluster, MySQLCluster, PostgreSQL]


def _statements(dialect: Dialect) -> dict[str, str]:
    return {name: dialect.sql(name) for name in sorted(dialect._clauses)}


@pytest.mark.parametrize("cls", [*SERVERS, SQLite])
def test_no_statement_reads_the_test_clock_outside_the_tests(cls: type[Dialect]) -> None:
    assert server_clock.offset_sql() is None
    for name, sql in _statements(cls()).items():
        assert server_clock.TABLE not in sql, name


@pytest.mark.parametrize("cls", SERVERS)
def test_inside_the_tests_every_reading_of_a_server_clock_is_moved(
    cls: type[Dialect], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_clock, "_installed", object())
    readings = {cls.now_sql, cls.clock_now_sql} - {""}
    moved = 0
    for name, sql in _statements(cls()).items():
        for reading in readings:
            found = sql.count(reading)
            assert sql.count(server_clock.clock_sql(reading)) == found, name
            moved += found
    assert moved > 20  # the lease statements read the clock; a rendering that lost them would pass above


def test_sqlite_keeps_its_own_offset_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    production = _statements(SQLite())
    monkeypatch.setattr(server_clock, "_installed", object())
    assert _statements(SQLite()) == production
