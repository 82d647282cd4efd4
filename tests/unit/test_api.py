"""The shape of the public API: exports, sync/async parity, the generated twin, the error registry."""

from __future__ import annotations

import asyncio
import inspect
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import permits
from permits._exceptions import PermitsError, error_class, error_codes

ROOT = Path(__file__).resolve().parents[2]


def test_all_is_sorted_and_complete() -> None:
    public = {
        name
        for name in dir(permits)
        if not name.startswith("_") and name not in ("annotations", "TYPE_CHECKING", "URL")
    }
    modules = {name for name in public if inspect.ismodule(getattr(permits, name))}
    assert set(permits.__all__) == (public - modules) | {"__version__"}
    assert permits.__all__ == sorted(permits.__all__, key=lambda n: (n.startswith("_"), n.islower(), n))


def _public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


@pytest.mark.parametrize(("sync", "asynchronous"), [(permits.Client, permits.AsyncClient)])
def test_async_twin_has_the_same_methods_and_signatures(sync: type, asynchronous: type) -> None:
    sync_methods = _public_methods(sync)
    async_methods = _public_methods(asynchronous)
    async_methods["close"] = async_methods.pop("aclose")
    assert sync_methods.keys() == async_methods.keys()
    for name, signature in sync_methods.items():
        twin = str(async_methods[name]).replace("AsyncHeld", "Held").replace("AsyncWatchdog", "Watchdog")
        assert str(signature) == twin, name
        assert inspect.iscoroutinefunction(getattr(asynchronous, "aclose" if name == "close" else name)) == (
            name not in ("lease", "mutex", "keepalive")  # these return context managers
        )


def test_generated_sync_twin_is_up_to_date() -> None:
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "unasync.py"), "--check"], capture_output=True)
    assert check.returncode == 0, check.stderr.decode()


def test_error_codes_are_unique_and_map_back() -> None:
    codes = error_codes()
    assert len(codes) == len(set(codes.values()))
    for code, cls in codes.items():
        assert cls.code == code and issubclass(cls, PermitsError)
        assert error_class(code) is cls
    assert error_class("a-code-from-a-newer-server") is PermitsError


def test_errors_pickle_with_their_details() -> None:
    original = permits.LeaseLost("lease 'k' has ended (expired)", key="k", reason="expired")
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is permits.LeaseLost and copy.reason == "expired" and str(copy) == str(original)


def test_builtin_bases() -> None:
    assert issubclass(permits.InvalidArgument, ValueError)
    assert issubclass(permits.AcquireTimeout, TimeoutError)
    assert issubclass(permits.SemaphoreNotFound, LookupError)
    assert issubclass(permits.UsageError, RuntimeError)
    for cls in error_codes().values():
        assert issubclass(cls, permits.PermitsError)


def test_another_store_plugs_in_by_url_scheme() -> None:
    """The seam for a non-SQL store (a Redis store is planned): the client only talks to the protocol."""
    from permits.stores import _ASYNC, _SYNC, register_store

    made: list[str] = []

    class FakeStore:
        url = "fake://here"

        def __init__(self, settings: object) -> None:
            made.append(type(settings).__name__)

        def release(self, owner: str, key: str, one_semaphore: bool = False) -> permits.ReleaseOutcome:
            return permits.ReleaseOutcome.NOT_FOUND

    register_store("fake", FakeStore, FakeStore)  # type: ignore[arg-type]
    try:
        client = permits.connect("fake://here")
        assert made == ["Settings"] and client.url == "fake://here"
        assert client.release("k") == permits.ReleaseOutcome.NOT_FOUND
    finally:
        _SYNC.pop("fake")
        _ASYNC.pop("fake")


def test_the_embedded_default_needs_nothing_beyond_the_core_dependencies(tmp_path: Path) -> None:
    """The asyncio client on SQLite runs the sync store on a worker thread (permits.stores.threaded), so it
    needs no asyncio driver for SQLite: with aiosqlite made unimportable, both spellings of the URL work."""
    script = """
import asyncio, sys
sys.modules["aiosqlite"] = None  # any import of it now fails
import permits

async def main():
    for url in ("sqlite:///a.db", "sqlite+aiosqlite:///b.db"):
        async with permits.connect_async(url) as client:
            await client.create_semaphore("s", 1)
            lease = await client.acquire("s", timeout=1)
            assert await client.try_acquire("s") is None
            await client.release(lease)
    print("ok")

asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("sqlite://", id="sqlite-in-memory"),
        pytest.param("sqlite:///:memory:", id="sqlite-memory-name"),
        pytest.param("mysql://root@127.0.0.1:9/test?foo=bar", id="mysql-unknown-parameter"),
        pytest.param("mysql+aiomysql://root@127.0.0.1:9/test?foo=bar", id="aiomysql-unknown-parameter"),
        pytest.param("mysql://root@127.0.0.1:9/test?connect_timeout=abc", id="mysql-unreadable-value"),
        pytest.param("mysql://root@127.0.0.1:9/test?charset=latin1", id="mysql-charset"),
        pytest.param("postgresql://u:s3cret@127.0.0.1:abc/test", id="port-not-a-number"),
        pytest.param("mysql://u:s3cret@127.0.0.1:abc/test", id="mysql-port-not-a-number"),
        pytest.param("postgresql://u:s3cret@127.0.0.1:1,127.0.0.1:2/test", id="several-hosts"),
        pytest.param("https://u:s3cret@127.0.0.1:abc", id="service-port-not-a-number"),
        pytest.param("https://u:s3cret@127.0.0.1:70000", id="service-port-out-of-range"),
        pytest.param("http://", id="service-without-a-host"),
        pytest.param("http+httpx://u:s3cret@127.0.0.1:8080", id="service-with-a-driver"),
        pytest.param("sqlite://host/x.db", id="sqlite-with-a-host"),
        pytest.param("postgresql://u:s3@cret@127.0.0.1:1/test", id="unencoded-at-in-password"),
    ],
)
def test_a_database_url_that_cannot_work_is_a_configuration_error(url: str) -> None:
    """Not a traceback from the driver, nor a client that half works (an in-memory SQLite database is one
    connection's own; the pool has several)."""
    with pytest.raises(permits.ConfigurationError) as refused, permits.connect(url) as client:
        client.list_semaphores()
    assert refused.value.details["field"] == "url"
    assert "cret" not in str(refused.value)  # no part of a password, whatever the URL's fault

    async def in_asyncio() -> None:
        async with permits.connect_async(url) as client:
            await client.list_semaphores()

    with pytest.raises(permits.ConfigurationError):
        asyncio.run(in_asyncio())


@pytest.mark.parametrize("parameter", ["password", "PASSWORD", "Passwd", "sslPassword"])
def test_a_secret_in_the_urls_query_is_never_shown(parameter: str) -> None:
    """Whatever its case: a driver refuses ``PASSWORD=`` (libpq's keywords are lower case), and the message
    that says so shows the URL."""
    client = permits.connect(f"postgresql://permits@127.0.0.1:1/test?{parameter}=s3cret")
    assert "s3cret" not in client.url and f"{parameter}=***" in client.url


@pytest.mark.parametrize(
    ("call", "field"),
    [
        pytest.param(lambda c: c.try_acquire("s", ttl=10**400), "ttl", id="ttl-past-any-float"),
        pytest.param(lambda c: c.acquire("s", timeout=10**400), "timeout", id="timeout-past-any-float"),
        pytest.param(lambda c: c.lease("s", max_hold=10**400), "max_hold", id="max-hold-past-any-float"),
        pytest.param(lambda c: c.lease("s", keepalive="yes"), "keepalive", id="keepalive-not-a-flag"),
        pytest.param(lambda c: c.drop_old_functions(dry_run=""), "dry_run", id="dry-run-not-a-flag"),
        pytest.param(lambda c: c.sweep(max_batches=0), "max_batches", id="max-batches-zero"),
    ],
)
def test_bad_arguments_are_named_and_nothing_is_held(tmp_path: Path, call: Any, field: str) -> None:
    """A typed error naming the argument, not an OverflowError, nor a truthy value taken for True (a
    ``dry_run=""`` that really drops)."""
    with permits.connect(f"sqlite:///{tmp_path / 'p.db'}") as client:
        client.create_semaphore("s", 1)
        with pytest.raises(permits.InvalidArgument) as refused:
            call(client)
        assert refused.value.details["field"] == field
        assert client.get_semaphore("s").used == 0


def test_a_lease_held_past_any_ttl_is_capped_at_the_longest_ttl(tmp_path: Path) -> None:
    """``max_hold`` longer than the longest TTL (1e308 s: ``permits run --max-hold 1e308``) only bounds
    the grant's TTL by that longest one; before, it overflowed."""
    with permits.connect(f"sqlite:///{tmp_path / 'p.db'}") as client:
        client.create_semaphore("s", 1)
        with client.lease("s", ttl=5, max_hold=1e308) as lease:
            assert lease.ttl == 5


@pytest.mark.parametrize("auto_upgrade", ["no", 1])
def test_auto_upgrade_is_a_flag(tmp_path: Path, auto_upgrade: Any) -> None:
    with pytest.raises(permits.InvalidArgument) as refused:
        permits.connect(f"sqlite:///{tmp_path / 'p.db'}", auto_upgrade=auto_upgrade)
    assert refused.value.details["field"] == "auto_upgrade"
    assert not (tmp_path / "p.db").exists()
