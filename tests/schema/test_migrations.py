"""The migrations, run the way an operator meets them: a database at an older revision, with state in it,
brought to the head and back. Each test gets a database of its own on the real servers (and a SQLite
file), since it moves the schema under everything else."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import make_url

import permits
from permits import _schema
from tests.conftest import own_database


@pytest.fixture
def fresh_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A URL to an empty database of this test's own."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'migrations.db'}"
        return
    with own_database(backend, "permits_m") as url:
        yield url


def _migrate(url: str, revision: str, down: bool = False) -> None:
    engine = create_engine(make_url(url))
    with engine.begin() as conn:
        config = _schema._config(conn)
        (command.downgrade if down else command.upgrade)(config, revision)
    engine.dispose()


def _one(conn: Connection, sql: str) -> int:
    return int(conn.execute(text(sql)).scalar_one())


def test_upgrading_keeps_places_in_fair_queues_ahead_and_downgrading_keeps_tickets_rising(
    fresh_url: str, backend: str
) -> None:
    """Revision 0005 takes tickets from a sequence on PostgreSQL. A place taken before the upgrade must
    stay ahead of those taken after it, and a downgrade must hand out no ticket taken already."""
    _migrate(fresh_url, "0004")
    engine = create_engine(make_url(fresh_url))
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO permits_semaphore (name, capacity, used, last_token, deleted, created_at_ms,"
                " updated_at_ms, fair, last_ticket) VALUES ('q', 1, 1, 0, 0, 0, 0, 1, 41)"
            )
        )
        sem_id = _one(conn, "SELECT id FROM permits_semaphore WHERE name = 'q'")
        conn.execute(
            text(
                "INSERT INTO permits_waiter (semaphore_id, ticket, owner, lease_key, count, enqueued_at_ms,"
                " expires_at_ms) VALUES (:id, 41, 'old', 'k', 1, 0, 9000000000000)"
            ),
            {"id": sem_id},
        )
    engine.dispose()
    _migrate(fresh_url, "head")

    with permits.connect(fresh_url, owner="new") as client:
        assert client.try_acquire("q", key="k", ttl=30) is None  # the old place is ahead
        with pytest.raises(permits.AcquireTimeout):
            client.acquire("q", key="k", ttl=30, timeout=0.3)  # waits, so it takes a place
        # try_acquire does not queue: the place above lapsed at once when the wait timed out. Take one
        # that stays, through the store, as a waiting acquire's attempt does.
        client._store.try_acquire("new", "k2", [permits.Want("q", 1)], 30_000, wait=5.0)  # type: ignore[attr-defined]
        queue = client.waiters("q")
    assert [(w.owner, w.key) for w in queue] == [("old", "k"), ("new", "k2")]
    assert queue[0].ticket < queue[1].ticket

    _migrate(fresh_url, "0004", down=True)
    engine = create_engine(make_url(fresh_url))
    with engine.connect() as conn:
        assert _one(conn, "SELECT last_ticket FROM permits_semaphore WHERE name = 'q'") >= queue[1].ticket
        assert _one(conn, "SELECT COUNT(*) FROM permits_waiter") == 2
    engine.dispose()
    _migrate(fresh_url, "head")  # and up again
    with permits.connect(fresh_url) as client:
        assert client.get_semaphore("q").fair


def test_a_schema_newer_than_this_code_is_refused_by_name_and_left_alone(fresh_url: str, backend: str) -> None:
    """A rolling upgrade: a newer permits moved the schema on while this one still runs. Opening it, with
    or without auto_upgrade, and `permits db upgrade` must say so (SchemaMismatch, "upgrade permits"),
    not fail inside Alembic on a revision it cannot find, and must not touch the schema."""
    _migrate(fresh_url, "head")
    engine = create_engine(make_url(fresh_url))
    with engine.begin() as conn:
        conn.execute(text("UPDATE permits_alembic_version SET version_num = '0999'"))
    probe = permits.connect(fresh_url)  # opens nothing until first use
    shown = probe.url
    probe.close()
    for auto_upgrade in (True, False):
        # The embedded default opens (and would upgrade) at connect(); a server's, at first use.
        with (
            pytest.raises(permits.SchemaMismatch, match="newer than this version of permits") as caught,
            permits.connect(fresh_url, auto_upgrade=auto_upgrade) as client,
        ):
            client.try_acquire("x")
        assert caught.value.code == "schema_mismatch" and "upgrade permits here" in str(caught.value)
        assert f" at {shown}" in str(caught.value)  # the database named as the client shows its URL
    with engine.begin() as conn, pytest.raises(permits.SchemaMismatch, match="upgrade permits"):
        _schema.upgrade(conn)
    done = subprocess.run(
        [sys.executable, "-m", "permits", "db", "upgrade", "--db", fresh_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "schema_mismatch" in done.stderr and "0999" in done.stderr, done.stderr
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM permits_alembic_version")).scalar_one() == "0999"
    engine.dispose()


def test_an_upgrade_behind_a_long_transaction_gives_up_in_bounded_time(fresh_url: str, backend: str) -> None:
    """An ALTER TABLE waits for every transaction that has read the table, and while it waits, the
    server queues every new statement on that table behind it: one forgotten open transaction (an
    operator's console) and an upgrade would stall every permits client. Its lock wait is bounded like a
    row lock's (``lock_wait_timeout``): the upgrade gives up with a retryable error, changes nothing, and
    succeeds once the table is free. (MariaDB's own bound on metadata locks is a year by default.)"""
    if backend == "sqlite":
        pytest.skip("SQLite's write lock is bounded by its busy timeout, tested with the store")
    _migrate(fresh_url, "0005")  # 0006 adds a column to permits_semaphore
    blocker_engine = create_engine(make_url(fresh_url))
    try:
        with blocker_engine.connect() as blocker:
            blocker.execute(text("SELECT COUNT(*) FROM permits_semaphore")).scalar_one()  # and stays open
            client = permits.connect(fresh_url, lock_wait_timeout=1, retries=1)
            started = time.monotonic()
            with pytest.raises(permits.StorageConflict):
                client.upgrade_schema()
            assert time.monotonic() - started < 20
            with blocker_engine.connect() as reader:  # nothing changed
                assert reader.execute(text("SELECT version_num FROM permits_alembic_version")).scalar_one() == "0005"
            blocker.rollback()
        assert client.upgrade_schema() == _schema.head()
        client.close()
    finally:
        blocker_engine.dispose()


def test_the_head_this_code_names_is_the_newest_migration() -> None:
    """``_schema.HEAD`` is written by hand, so that opening a store need not import Alembic to read the
    migrations' directory: it must be the head Alembic finds there."""
    from alembic.script import ScriptDirectory

    assert _schema.head() == ScriptDirectory.from_config(_schema._config()).get_current_head()


def test_the_revision_is_read_as_alembic_reads_it(fresh_url: str, backend: str) -> None:
    """``_schema.current`` reads the version table itself: nothing where permits never was, an empty table
    as no revision, and an older revision as such, which the store refuses until it is upgraded."""
    engine = create_engine(make_url(fresh_url))
    try:
        with engine.connect() as conn:
            assert _schema.current(conn) is None
        _migrate(fresh_url, "0008")
        with engine.connect() as conn:
            assert _schema.current(conn) == "0008"
        with (
            pytest.raises(permits.SchemaMismatch, match=f"at revision 0008; this version needs {_schema.HEAD}"),
            permits.connect(fresh_url, auto_upgrade=False) as client,
        ):
            client.try_acquire("x")
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM permits_alembic_version"))
        with engine.connect() as conn:
            assert _schema.current(conn) is None
    finally:
        engine.dispose()


def test_opening_an_up_to_date_schema_does_not_import_alembic(fresh_url: str, backend: str) -> None:
    """Every `permits run` opens a store: on a schema at the head it reads the revision without Alembic,
    whose import is about a third of a process's start-up (docs/benchmarks.md, "Start-up")."""
    _migrate(fresh_url, "head")
    script = (
        "import sys, permits\n"
        f"with permits.connect({fresh_url!r}, auto_upgrade=False) as client:\n"
        "    client.create_semaphore('startup', 1, exist_ok=True)\n"
        "    client.release(client.acquire('startup', timeout=5))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "[]", done.stdout


#: the columns 0001, 0003 and 0004 give the byte-exact collation (see migration 0010)
EXACT_COLUMNS = importlib.import_module("permits.migrations.versions.0010_mariadb_lines").EXACT_COLUMNS
_EXACT = [(table, column) for table, columns in EXACT_COLUMNS.items() for column in columns]


def _collations(conn: Connection) -> dict[tuple[str, str], str]:
    rows = conn.execute(
        text(
            "SELECT TABLE_NAME, COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS"
            " WHERE TABLE_SCHEMA = DATABASE() AND COLLATION_NAME IS NOT NULL"
        )
    ).all()
    return {(str(t), str(c)): str(k) for t, c, k in rows}


@pytest.mark.parametrize("backend", ["mysql"])
def test_a_mariadb_url_gets_names_compared_byte_for_byte(fresh_url: str) -> None:
    """A mariadb:// URL is SQLAlchemy's MySQL dialect under the name "mariadb". permits drives it as mysql://,
    so its schema gets the byte-exact collation (before, the migrations, looking for "mysql", left the
    server's default one, and "lock" and "Lock" were one semaphore)."""
    url = fresh_url.replace("mysql+pymysql://", "mariadb://")
    with permits.connect(url, auto_upgrade=True) as client:
        client.create_semaphore("lock", 1)
        client.create_semaphore("Lock", 1)
        client.create_semaphore("lock ", 1)
        assert [s.name for s in client.list_semaphores("")] == ["Lock", "lock", "lock "]
    engine = create_engine(make_url(fresh_url))
    with engine.connect() as conn:
        assert {_collations(conn)[where] for where in _EXACT} == {"utf8mb4_nopad_bin"}
    engine.dispose()


@pytest.mark.parametrize("backend", ["mysql"])
def test_upgrading_a_schema_made_through_a_mariadb_url_makes_its_names_exact(fresh_url: str) -> None:
    """A schema that an older permits made through a mariadb:// URL (here: migrated to 0009 under SQLAlchemy's
    "mariadb" dialect, as it was) has its names in the default collation; 0010 gives them the exact one."""
    _migrate(fresh_url.replace("mysql+pymysql://", "mariadb+pymysql://"), "0009")
    engine = create_engine(make_url(fresh_url))
    with engine.connect() as conn:
        before = _collations(conn)
    assert all(before[where] != "utf8mb4_nopad_bin" for where in _EXACT), before
    with permits.connect(fresh_url.replace("mysql+pymysql://", "mariadb://"), auto_upgrade=True) as client:
        client.create_semaphore("lock", 1)
        client.create_semaphore("Lock", 1)
    with engine.connect() as conn:
        assert {_collations(conn)[where] for where in _EXACT} == {"utf8mb4_nopad_bin"}
        assert conn.execute(text("SELECT COUNT(*) FROM permits_line")).scalar_one() == 1023
    engine.dispose()
