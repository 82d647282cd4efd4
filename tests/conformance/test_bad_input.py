"""Bad input gets a typed error before anything is written; a database that is down gets a clear one."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import permits
from permits import CountExceedsCapacity, InvalidArgument, _schema

BAD_ACQUIRES = [
    pytest.param({"": 1}, {}, id="empty-name"),
    pytest.param({"x" * 256: 1}, {}, id="name-too-long"),
    pytest.param({"a\x00b": 1}, {}, id="name-with-nul"),
    pytest.param({"\ud800": 1}, {}, id="name-lone-surrogate"),
    pytest.param({"{s}": 0}, {}, id="count-zero"),
    pytest.param({"{s}": -1}, {}, id="count-negative"),
    pytest.param({"{s}": True}, {}, id="count-bool"),
    pytest.param({"{s}": 1.5}, {}, id="count-float"),
    pytest.param({"{s}": "1"}, {}, id="count-string"),
    pytest.param([("{s}", 1), ("{s}", 1)], {}, id="same-semaphore-twice"),
    pytest.param({}, {}, id="empty-request"),
    pytest.param([], {}, id="empty-list"),
    pytest.param(42, {}, id="not-a-request"),
    pytest.param({"{s}": 1}, {"ttl": 0}, id="ttl-zero"),
    pytest.param({"{s}": 1}, {"ttl": -5}, id="ttl-negative"),
    pytest.param({"{s}": 1}, {"ttl": math.nan}, id="ttl-nan"),
    pytest.param({"{s}": 1}, {"ttl": math.inf}, id="ttl-inf"),
    pytest.param({"{s}": 1}, {"ttl": 31 * 24 * 3600}, id="ttl-above-max"),
    pytest.param({"{s}": 1}, {"ttl": True}, id="ttl-bool"),
    pytest.param({"{s}": 1}, {"ttl": "10"}, id="ttl-string"),
    pytest.param({"{s}": 1}, {"key": "k" * 256}, id="key-too-long"),
    pytest.param({"{s}": 1}, {"key": ""}, id="key-empty"),
    pytest.param({"{s}": 1}, {"owner": "o\x00"}, id="owner-with-nul"),
    pytest.param({"{s}": 1}, {"timeout": -1}, id="timeout-negative"),
    pytest.param({"{s}": 1}, {"timeout": math.nan}, id="timeout-nan"),
]


def _fill(value: Any, name: str) -> Any:
    if isinstance(value, dict):
        return {k.replace("{s}", name): v for k, v in value.items()}
    if isinstance(value, list):
        return [(k.replace("{s}", name), v) for k, v in value]
    return value


@pytest.mark.parametrize(("wants", "options"), BAD_ACQUIRES)
def test_bad_acquire_is_refused_and_writes_nothing(client: Any, ns: str, wants: Any, options: dict[str, Any]) -> None:
    name = f"{ns}s"
    client.create_semaphore(name, 3)
    calls = (client.acquire,) if "timeout" in options else (client.try_acquire, client.acquire)
    for call in calls:
        with pytest.raises(InvalidArgument) as raised:
            call(_fill(wants, name), **options)
        assert raised.value.details.get("field"), "the error names the bad argument"
        assert isinstance(raised.value, ValueError) and isinstance(raised.value, permits.PermitsError)
    sem = client.get_semaphore(name)
    assert (sem.used, sem.last_token) == (0, 0)
    assert client.holders(name) == []


def test_count_above_capacity(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 3)
    with pytest.raises(CountExceedsCapacity) as raised:
        client.acquire({f"{ns}s": 4}, timeout=None)  # would otherwise wait for ever
    assert raised.value.details["capacity"] == 3
    assert client.get_semaphore(f"{ns}s").used == 0


@pytest.mark.parametrize("capacity", [0, -1, True, 1.0, "3", 2**53])
def test_bad_capacity(client: Any, ns: str, capacity: Any) -> None:
    with pytest.raises(InvalidArgument):
        client.create_semaphore(f"{ns}s", capacity)
    assert client.list_semaphores(ns) == []
    client.create_semaphore(f"{ns}s", 2)
    with pytest.raises(InvalidArgument):
        client.set_capacity(f"{ns}s", capacity, reason="x")
    assert client.get_semaphore(f"{ns}s").capacity == 2
    assert len(client.capacity_history(f"{ns}s")) == 1


@pytest.mark.parametrize("name", ["", "n" * 256, "a\x00", None, 5])
def test_bad_semaphore_name(client: Any, name: Any) -> None:
    with pytest.raises(InvalidArgument):
        client.create_semaphore(name, 1)
    with pytest.raises(InvalidArgument):
        client.get_semaphore(name)


def test_bad_reason_and_release_arguments(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 2)
    with pytest.raises(InvalidArgument):
        client.set_capacity(f"{ns}s", 3, reason="r" * 1001)
    for blank in ("", "  "):  # a capacity change and a revoke must say why, here as through the service
        with pytest.raises(InvalidArgument):
            client.set_capacity(f"{ns}s", 3, reason=blank)
        with pytest.raises(InvalidArgument):
            client.revoke("k", owner="o", reason=blank)
    with pytest.raises(InvalidArgument):
        client.release("")
    with pytest.raises(InvalidArgument):
        client.extend("k" * 300, 10)
    lease = client.try_acquire(f"{ns}s")
    for ttl in (0, -1, math.nan, math.inf, 10**9):
        with pytest.raises(InvalidArgument):
            client.extend(lease, ttl)
    for bad in (-1, math.nan, "soon", True):
        for call in (client.extend, client.release):
            with pytest.raises(InvalidArgument) as refused:
                call(lease, timeout=bad)
            assert refused.value.details["field"] == "timeout", refused.value
        with pytest.raises(InvalidArgument) as refused:
            client.revoke(lease, reason="stuck", timeout=bad)
        assert refused.value.details["field"] == "timeout", refused.value
    assert 0 < client.get_lease(lease.key).expires_in <= 60  # still held: not extended, not revoked


def test_a_bad_timeout_for_a_read_or_a_change_is_refused_and_changes_nothing(client: Any, ns: str) -> None:
    """The reads and the semaphores' changes take a ``timeout`` as ``release`` does: a bad one is an
    ``InvalidArgument`` naming the field, before anything is asked."""
    name = f"{ns}s"
    client.create_semaphore(name, 2)
    lease = client.try_acquire(name)
    calls: dict[str, Callable[[Any], Any]] = {
        "get_lease": lambda bad: client.get_lease(lease.key, timeout=bad),
        "holders": lambda bad: client.holders(name, timeout=bad),
        "waiters": lambda bad: client.waiters(name, timeout=bad),
        "get_semaphore": lambda bad: client.get_semaphore(name, timeout=bad),
        "list_semaphores": lambda bad: client.list_semaphores(ns, timeout=bad),
        "capacity_history": lambda bad: client.capacity_history(name, timeout=bad),
        "create_semaphore": lambda bad: client.create_semaphore(f"{ns}new1", 1, timeout=bad),
        "create_mutex": lambda bad: client.create_mutex(f"{ns}new2", timeout=bad),
        "create_rwlock": lambda bad: client.create_rwlock(f"{ns}new3", timeout=bad),
        "set_capacity": lambda bad: client.set_capacity(name, 5, reason="more", timeout=bad),
        "delete_semaphore": lambda bad: client.delete_semaphore(name, force=True, timeout=bad),
        "sweep": lambda bad: client.sweep(timeout=bad),
        "reconcile": lambda bad: client.reconcile(repair=True, timeout=bad),
    }
    for bad in (-1, math.nan, "soon", True):
        for what, call in calls.items():
            with pytest.raises(InvalidArgument) as refused:
                call(bad)
            assert refused.value.details["field"] == "timeout", (what, refused.value)
    assert client.get_semaphore(name).capacity == 2
    assert [h.key for h in client.holders(name)] == [lease.key]
    assert [s.name for s in client.list_semaphores(ns)] == [name]
    for call in calls.values():  # and a good one is taken
        call(5)
    assert [s.name for s in client.list_semaphores(ns)] == [f"{ns}new1", f"{ns}new2", f"{ns}new3"]


def test_flags_and_limits_are_checked_and_named(client: Any, ns: str) -> None:
    """``exist_ok="no"`` is truthy: read as a flag it would do the opposite of what it says."""
    client.create_semaphore(f"{ns}s", 2)
    for call, field in (
        (lambda: client.create_semaphore(f"{ns}s", 2, exist_ok="no"), "exist_ok"),
        (lambda: client.create_semaphore(f"{ns}t", 2, fair=1), "fair"),
        (lambda: client.delete_semaphore(f"{ns}s", force="yes"), "force"),
        (lambda: client.reconcile(repair=1), "repair"),
        (lambda: client.capacity_history(f"{ns}s", limit=0), "limit"),
        (lambda: client.ping(timeout=-1), "timeout"),
        (lambda: client.ping(timeout="soon"), "timeout"),
    ):
        with pytest.raises(InvalidArgument) as refused:
            call()
        assert refused.value.details["field"] == field, refused.value
    assert [s.name for s in client.list_semaphores(prefix=ns)] == [f"{ns}s"]


def test_a_bad_lock_wait_timeout_is_named(tmp_path: Any) -> None:
    with pytest.raises(InvalidArgument) as refused:
        permits.connect(f"sqlite:///{tmp_path / 'p.db'}", lock_wait_timeout=math.nan)
    assert refused.value.details["field"] == "lock_wait_timeout"


def test_longest_valid_name_and_key(client: Any, ns: str) -> None:
    name = (ns + "é" * 255)[:255]
    client.create_semaphore(name, 1)
    owner = (ns + "ö" * 255)[:255]
    lease = client.try_acquire(name, key="ü" * 255, owner=owner)
    assert client.get_lease("ü" * 255, owner=owner).tokens == lease.tokens


def test_closed_client(make_client: Any) -> None:
    closed = make_client()
    closed.close()
    with pytest.raises(permits.UsageError):
        closed.try_acquire("x")


@pytest.mark.parametrize(
    "url",
    [
        "mysql://root:s3cret@127.0.0.1:1/nothing",
        "postgresql://postgres:s3cret@127.0.0.1:1/nothing",
    ],
)
def test_database_down_is_a_clear_error(url: str) -> None:
    client = permits.connect(url, retries=1)
    with pytest.raises(permits.StorageUnavailable) as raised:
        client.try_acquire("x")
    message = str(raised.value)
    assert "127.0.0.1:1" in message and "s3cret" not in message and "***" in message
    assert "SELECT" not in message.upper() and "Traceback" not in message
    assert raised.value.retryable
    client.close()


def test_sqlite_file_that_cannot_be_opened(tmp_path: Any) -> None:
    client = permits.connect(f"sqlite:///{tmp_path}/missing-dir/permits.db", retries=0)
    with pytest.raises(permits.StorageUnavailable):
        client.try_acquire("x")
    client.close()


@pytest.mark.parametrize("url", ["", "nonsense", "oracle://x/y", "mysql+nodriver://x/y", "postgresql+asyncpg://x/y"])
def test_bad_url(url: str) -> None:
    with pytest.raises((permits.ConfigurationError, permits.InvalidArgument)):
        permits.connect(url).try_acquire("x")


@pytest.mark.parametrize("query", ["mode=ro", "cache=shared&mode=ro", "vfs=unix-dotfile"])
def test_sqlites_own_parameters_outside_a_file_uri_are_refused(tmp_path: Path, query: str) -> None:
    """SQLite reads mode=ro and the like only from a file: URI. SQLAlchemy drops them from a plain URL with
    a warning nobody sees, so ``?mode=ro`` opened the file read-write: it is refused, with the form to use,
    and nothing is made."""
    path = tmp_path / "permits.db"
    with (
        pytest.raises(permits.ConfigurationError, match=r"only from a file: URI") as refused,
        permits.connect(f"sqlite:///{path}?{query}") as client,
    ):
        client.list_semaphores()
    assert refused.value.details == {"field": "url"}
    assert f"sqlite:///file:{path}?{query}&uri=true" in str(refused.value)
    assert not path.exists()


@pytest.mark.parametrize("query", ["immutable=1", "nolock=1&uri=true", "mode=ro&immutable=1&uri=true"])
def test_sqlite_parameters_that_drop_its_locking_are_refused(tmp_path: Path, query: str) -> None:
    path = tmp_path / "permits.db"
    with (
        pytest.raises(permits.ConfigurationError, match="turn off the file locking") as refused,
        permits.connect(f"sqlite:///file:{path}?{query}") as client,
    ):
        client.list_semaphores()
    assert refused.value.details == {"field": "url"} and not path.exists()


@pytest.mark.parametrize(
    "written",
    [
        "file:{path}%3Fnolock=1?uri=true",  # "?" encoded in the path: SQLAlchemy decodes it, and SQLite reads a query
        "file:{path}%3Fmode=rw&immutable=1?uri=true",
        "file:{path}?no%256Cock=1&uri=true",  # the name encoded: SQLite decodes it to nolock
        "file:{path}?vfs=unix-none&uri=true",  # a VFS that takes no locks
        "file:{path}%3Fvfs=unix-none?uri=true",
    ],
)
def test_sqlite_parameters_that_drop_its_locking_are_refused_however_they_are_written(
    tmp_path: Path, written: str
) -> None:
    """They were let through (and the file opened without its locks, as far as SQLite was concerned)."""
    path = tmp_path / "permits.db"
    with (
        pytest.raises(permits.ConfigurationError, match="turn off the file locking"),
        permits.connect("sqlite:///" + written.format(path=path)) as client,
    ):
        client.list_semaphores()
    assert not path.exists()


def test_sqlite_parameters_on_a_path_given_uri_true_are_refused(tmp_path: Path) -> None:
    """``sqlite:///x.db?mode=ro&uri=true``: the driver opened a file named ``x.db?mode=ro``, writable, beside
    the one meant. Refused, naming the file: form."""
    path = tmp_path / "permits.db"
    with (
        pytest.raises(permits.ConfigurationError, match="is a path") as refused,
        permits.connect(f"sqlite:///{path}?mode=ro&uri=true") as client,
    ):
        client.list_semaphores()
    assert f"sqlite:///file:{path}?" in str(refused.value)
    assert list(tmp_path.iterdir()) == []


def test_the_file_uri_suggested_for_an_odd_path_opens_that_file(tmp_path: Path) -> None:
    """The path is quoted twice in the suggestion: SQLAlchemy unquotes it once, and SQLite the URI again."""
    path = tmp_path / "a b%20c#d.db"
    with permits.connect(f"sqlite:///{path}") as client:
        client.create_semaphore("s", capacity=1)
    with pytest.raises(permits.ConfigurationError) as refused, permits.connect(f"sqlite:///{path}?mode=ro") as client:
        client.list_semaphores()
    suggested = str(refused.value).rsplit("write it ", 1)[1]
    with permits.connect(suggested) as client:
        assert [s.name for s in client.list_semaphores()] == ["s"]


def test_a_read_only_sqlite_file_uri_reads_and_refuses_writes(tmp_path: Path) -> None:
    path = tmp_path / "permits.db"
    with permits.connect(f"sqlite:///{path}") as client:
        client.create_semaphore("s", capacity=1)
    with permits.connect(f"sqlite:///file:{path}?mode=ro&uri=true") as client:
        assert [s.name for s in client.list_semaphores() if s.name == "s"] == ["s"]
        with pytest.raises(permits.StorageReadOnly, match="opened read-only"):
            client.acquire("s", timeout=1)
        with pytest.raises(permits.StorageReadOnly):
            client.create_semaphore("t", capacity=1)
    with permits.connect(f"sqlite:///{path}") as client:
        assert client.get_semaphore("s").used == 0
        with pytest.raises(permits.SemaphoreNotFound):
            client.get_semaphore("t")


def test_server_without_schema_says_how_to_fix(servers: Any, backend: str) -> None:
    if backend == "sqlite":
        pytest.skip("SQLite creates its schema on first use")
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    url = servers.url_for(backend)
    empty = url.set(database=f"{url.database}_empty")
    admin = create_engine(
        url.set(drivername="mysql+pymysql" if backend == "mysql" else "postgresql+psycopg"),
        isolation_level="AUTOCOMMIT",
    )
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {empty.database}"))
    try:
        client = permits.connect(empty)
        with pytest.raises(permits.SchemaMismatch, match="permits db upgrade"):
            client.try_acquire("x")
        assert client.upgrade_schema() == _schema.head()
        client.create_semaphore("x", 1)
        assert client.try_acquire("x") is not None
        client.close()
    finally:
        with admin.connect() as conn:
            extra = " WITH (FORCE)" if backend == "postgresql" else ""
            conn.execute(text(f"DROP DATABASE {empty.database}{extra}"))
        admin.dispose()
    assert make_url(str(empty)).database.endswith("_empty")
