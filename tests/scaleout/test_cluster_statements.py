"""The statements a multi-primary cluster node gets (one per request, no batches: dialects/mysql.py), run
on the plain MariaDB server with the cluster dialect forced, so that they are tested in seconds and
without a cluster. tests/scaleout/test_galera.py runs them, and the behaviour suite, on a real one."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text

import permits
import permits._async.store as async_store
import permits._sync.store as sync_store
from permits.dialects.mysql import MariaDBCluster


@pytest.fixture
def cluster_url(servers: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for module in (sync_store, async_store):
        monkeypatch.setattr(module, "is_multi_primary", lambda variables: True)
    yield servers.url_for("mysql").render_as_string(hide_password=False)


def _waiter_rows(url: str, owner: str) -> int:
    engine = create_engine(url.replace("mysql://", "mysql+pymysql://"))
    with engine.connect() as conn:
        count = conn.execute(text("SELECT COUNT(*) FROM permits_waiter WHERE owner = :o"), {"o": owner}).scalar()
    engine.dispose()
    return int(count or 0)


def test_grants_releases_and_replays_one_statement_at_a_time(cluster_url: str, ns: str) -> None:
    with permits.connect(cluster_url, owner=f"{ns}o") as client:
        client.create_semaphore(f"{ns}a", 2)
        client.create_semaphore(f"{ns}b", 1)
        assert isinstance(client._store._dialect, MariaDBCluster)
        first = client.acquire(f"{ns}a", key="k1", ttl=30)
        assert first.token == 1
        again = client.acquire(f"{ns}a", key="k1", ttl=30)  # a retry gets the same grant
        assert (again.tokens, again.acquired_at) == (first.tokens, first.acquired_at)
        both = client.acquire({f"{ns}a": 1, f"{ns}b": 1}, key="k2", ttl=30)
        assert both.tokens == {f"{ns}a": 2, f"{ns}b": 1}
        assert client.try_acquire(f"{ns}a", key="k3") is None  # full
        assert client.extend(first, ttl=60).expires_in > 30
        assert client.release(first) is permits.ReleaseOutcome.RELEASED
        assert client.release(first) is not permits.ReleaseOutcome.RELEASED
        assert client.release(both) is permits.ReleaseOutcome.RELEASED
        assert client.get_semaphore(f"{ns}a").used == 0
        assert client.get_semaphore(f"{ns}b").used == 0
        assert client.reconcile() == []


def test_a_waiter_granted_in_a_fair_queue_leaves_it(cluster_url: str, ns: str) -> None:
    name, waiter_owner = f"{ns}fair", f"{ns}w"
    with (
        permits.connect(cluster_url, owner=f"{ns}h") as holder,
        permits.connect(cluster_url, owner=waiter_owner) as waiter,
    ):
        holder.create_semaphore(name, 1, fair=True)
        held = holder.acquire(name, ttl=30)
        granted: list[permits.Lease] = []
        thread = threading.Thread(target=lambda: granted.append(waiter.acquire(name, ttl=30, timeout=20)))
        thread.start()
        time.sleep(1.0)
        assert _waiter_rows(cluster_url, waiter_owner) == 1  # it queued
        holder.release(held)
        thread.join(30)
        assert granted and granted[0].token == 2
        assert _waiter_rows(cluster_url, waiter_owner) == 0  # and its place went with the grant


def test_the_asyncio_client_gets_the_cluster_statements_too(cluster_url: str, ns: str) -> None:
    async def scenario() -> None:
        async with permits.connect_async(cluster_url, owner=f"{ns}o") as client:
            await client.create_semaphore(f"{ns}s", 1)
            lease = await client.acquire(f"{ns}s", ttl=30)
            assert isinstance(client._store._dialect, MariaDBCluster)
            assert await client.release(lease) is permits.ReleaseOutcome.RELEASED

    asyncio.run(scenario())
