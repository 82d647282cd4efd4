"""permits beside a PostgreSQL primary and its streaming hot standby (tests/_pg_standby.py).

- A write sent to the standby (acquire, release, extend) fails at once, with an error that says what to
  do; reads work there, and may be a little behind the primary.
- After the standby is promoted, clients pointed at it carry on: every acknowledged grant is still there
  (the pair runs with synchronous_commit = remote_apply), a retried request finds its lease, and fencing
  tokens keep increasing from where they were.
- A client whose URL names both servers (``target_session_attrs=read-write``) follows the promotion with no
  change: its calls fail during the outage, and afterwards go to the promoted server.

A few seconds per pair: each test starts its own, since a promotion ends it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import permits
from tests._pg_standby import PgPrimaryStandby

pytestmark = pytest.mark.slow


@pytest.fixture
def pair() -> Iterator[PgPrimaryStandby]:
    with PgPrimaryStandby(synchronous=True) as pg:
        with permits.connect(pg.primary_url, auto_upgrade=True) as client:
            client.list_semaphores()  # the schema, on the primary, streamed to the standby
        yield pg


def test_writes_sent_to_a_standby_fail_at_once_and_reads_work(pair: PgPrimaryStandby) -> None:
    with permits.connect(pair.primary_url, owner="app") as primary:
        primary.create_semaphore("backups", 2)
        held = primary.acquire("backups", key="nightly", ttl=60)
    pair.wait_replayed()
    with permits.connect(pair.standby_url, owner="app") as standby:
        for write in (
            lambda: standby.try_acquire("backups", key="another"),
            lambda: standby.release(held),
            lambda: standby.extend(held, ttl=60),
        ):
            began = time.monotonic()
            with pytest.raises(permits.StorageReadOnly) as refused:
                write()
            assert time.monotonic() - began < 2, "a read-only replica is not worth retrying"
            assert "read-only replica; point permits at the primary" in str(refused.value)
            assert refused.value.code == "storage_read_only"
        # Reads may use the standby (possibly stale: here it has replayed everything).
        assert [h.key for h in standby.holders("backups")] == ["nightly"]
        assert standby.get_semaphore("backups").used == 1
        assert standby.get_lease("nightly").tokens == held.tokens


def test_after_a_promotion_clients_carry_on_with_larger_tokens(pair: PgPrimaryStandby) -> None:
    with permits.connect(pair.primary_url, owner="app") as primary:
        primary.create_semaphore("deploys", 1)
        for i in range(5):
            primary.release(primary.acquire("deploys", key=f"before-{i}", ttl=60))
        kept = primary.acquire("deploys", key="kept", ttl=60)
    # The primary dies. With remote_apply, every grant it acknowledged is already on the standby.
    pair.stop_primary(mode="immediate")
    pair.promote()
    with permits.connect(pair.standby_url, owner="app") as promoted:
        # The grant acknowledged before the failover is there; a retry of it gets the same lease.
        again = promoted.acquire("deploys", key="kept", ttl=60, timeout=5)
        assert again.tokens == kept.tokens
        assert promoted.try_acquire("deploys", key="late") is None  # capacity still holds across it
        promoted.release(again)
        tokens = [kept.token]
        for i in range(5):
            lease = promoted.acquire("deploys", key=f"after-{i}", ttl=60, timeout=5)
            tokens.append(lease.token)
            promoted.release(lease)
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
        assert promoted.reconcile() == []


def test_a_client_given_both_servers_follows_the_failover_on_its_own(pair: PgPrimaryStandby) -> None:
    """One URL that names both servers, with ``target_session_attrs=read-write`` (libpq's, which psycopg
    reads): each new connection goes to whichever of them takes writes. So the same client, left as it is,
    carries on after the promotion; during the outage its calls fail at once with ``StorageUnavailable``,
    and its retry with the same key after the failover is answered with the lease it got before."""
    both = (
        f"postgresql://postgres@/test?host=127.0.0.1:{pair.primary_port}&host=127.0.0.1:{pair.standby_port}"
        "&target_session_attrs=read-write"
    )
    with permits.connect(both, owner="app") as client:
        client.create_semaphore("deploys", 1)
        kept = client.acquire("deploys", key="kept", ttl=60)
        pair.stop_primary(mode="immediate")
        began = time.monotonic()
        with pytest.raises(permits.StorageUnavailable):
            client.try_acquire("deploys", key="during")
        assert time.monotonic() - began < 10
        pair.promote()
        again = client.acquire("deploys", key="kept", ttl=60, timeout=5)
        assert again.tokens == kept.tokens
        assert client.try_acquire("deploys", key="late") is None  # capacity still holds across it
        client.release(again)
        after = client.acquire("deploys", key="after", ttl=60, timeout=5)
        assert after.token > kept.token
        client.release(after)
        assert client.reconcile() == []
