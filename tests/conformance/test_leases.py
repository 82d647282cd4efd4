"""Acquire, release, extend, idempotency, expiry and the sweep. Every backend, both clients."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest

import permits
from permits import EndReason, ReleaseOutcome
from permits._sync.store import MAX_RESTARTS


def test_acquire_and_release(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 2)
    first = client.acquire(f"{ns}s", ttl=30)
    assert first.counts == {f"{ns}s": 1} and first.held
    assert 29 <= first.expires_in <= 30
    assert first.expires_at > first.acquired_at
    second = client.try_acquire({f"{ns}s": 1})
    assert second is not None and second.token > first.token
    assert client.try_acquire(f"{ns}s") is None  # full
    assert client.get_semaphore(f"{ns}s").used == 2
    assert client.release(first) == ReleaseOutcome.RELEASED
    assert client.release(first) == ReleaseOutcome.ALREADY_RELEASED
    assert client.release(f"{ns}never-granted") == ReleaseOutcome.NOT_FOUND
    assert client.get_semaphore(f"{ns}s").used == 1
    assert client.get_lease(first.key).end_reason == EndReason.RELEASED


def test_counts_and_all_or_nothing(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}a", 5)
    client.create_semaphore(f"{ns}b", 2)
    lease = client.try_acquire({f"{ns}a": 3, f"{ns}b": 2})
    assert lease.counts == {f"{ns}a": 3, f"{ns}b": 2}
    assert set(lease.tokens) == {f"{ns}a", f"{ns}b"}
    # b is full: asking for a and b takes nothing from a either.
    assert client.try_acquire({f"{ns}a": 1, f"{ns}b": 1}) is None
    assert client.get_semaphore(f"{ns}a").used == 3
    assert client.try_acquire([(f"{ns}a", 2)]) is not None
    assert client.try_acquire({f"{ns}a": 1}) is None
    client.release(lease)
    assert client.get_semaphore(f"{ns}a").used == 2 and client.get_semaphore(f"{ns}b").used == 0


def test_tokens_strictly_increase(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 3)
    seen = []
    for _ in range(10):
        lease = client.try_acquire(f"{ns}s")
        seen.append(lease.token)
        client.release(lease)
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert client.get_semaphore(f"{ns}s").last_token == seen[-1]


@pytest.mark.parametrize("several", [False, True], ids=["one-semaphore", "two-semaphores"])
def test_a_zero_timeout_is_one_attempt_that_grants_when_there_is_room(client: Any, ns: str, several: bool) -> None:
    """``timeout=0`` asks once and does not wait. On PostgreSQL such a waiting acquire's attempt went through
    the queued grant with no time to wait in the line, and the queued grant refused it after taking its
    turn, without asking: a free semaphore answered AcquireTimeout."""
    client.create_semaphore(f"{ns}a", 1)
    client.create_semaphore(f"{ns}b", 1)
    wants = {f"{ns}a": 1, f"{ns}b": 1} if several else f"{ns}a"
    lease = client.acquire(wants, timeout=0)
    with pytest.raises(permits.AcquireTimeout):
        client.acquire(wants, timeout=0)
    client.release(lease)
    client.release(client.acquire(wants, timeout=0))
    assert client.get_semaphore(f"{ns}a").used == 0


def test_retry_with_same_key_never_grants_twice(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 1)
    lease = client.try_acquire(f"{ns}s", key=f"{ns}job-42")
    again = client.try_acquire(f"{ns}s", key=f"{ns}job-42")  # a retry: no room, but it is the same request
    assert again == lease or (again.tokens, again.key) == (lease.tokens, lease.key)
    assert client.acquire(f"{ns}s", key=f"{ns}job-42", timeout=0).tokens == lease.tokens
    assert client.get_semaphore(f"{ns}s").used == 1
    assert len(client.holders(f"{ns}s")) == 1


def test_retry_that_finds_room_takes_none(client: Any, ns: str) -> None:
    # The retry's grant statement takes the room and bumps the token before its lease insert hits the key:
    # all of that must be rolled back (on MariaDB, a batch that stopped half-way), and the lease answered.
    client.create_semaphore(f"{ns}s", 3)
    lease = client.try_acquire(f"{ns}s", key=f"{ns}job-7")
    for _ in range(3):
        again = client.acquire(f"{ns}s", key=f"{ns}job-7", timeout=0)
        assert (again.key, again.tokens) == (lease.key, lease.tokens)
    sem = client.get_semaphore(f"{ns}s")
    assert (sem.used, sem.last_token) == (1, lease.tokens[f"{ns}s"])
    assert client.reconcile() == []


def test_same_key_different_request_conflicts(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 3)
    client.try_acquire({f"{ns}s": 1}, key=f"{ns}k")
    with pytest.raises(permits.IdempotencyConflict):
        client.try_acquire({f"{ns}s": 2}, key=f"{ns}k")
    assert client.get_semaphore(f"{ns}s").used == 1


def test_a_request_for_a_new_lease_only_is_never_answered_with_one_under_its_key(client: Any, ns: str) -> None:
    """``new_only``: the key is not a retry's but a claim. A lease under it, held or ended, is refused with
    KeyInUse (an IdempotencyConflict), whether there is room or not, and is left as it was."""
    client.create_semaphore(f"{ns}s", 2)
    first = client.acquire(f"{ns}s", key=f"{ns}k", new_only=True)
    for timeout in (0, 1):  # with room, and waiting: refused at once either way
        with pytest.raises(permits.KeyInUse) as refused:
            client.acquire(f"{ns}s", key=f"{ns}k", new_only=True, timeout=timeout)
        assert refused.value.code == "key_in_use" and refused.value.details["held"] is True
        assert isinstance(refused.value, permits.IdempotencyConflict)
    with pytest.raises(permits.KeyInUse):
        client.try_acquire(f"{ns}s", key=f"{ns}k", new_only=True)
    with pytest.raises(permits.KeyInUse), client.lease(f"{ns}s", key=f"{ns}k", new_only=True):
        pass
    assert client.acquire(f"{ns}s", key=f"{ns}k").tokens == first.tokens  # a retry is answered with it
    assert client.get_semaphore(f"{ns}s").used == 1
    # Full: refused for the key, not timed out.
    other = client.acquire(f"{ns}s")
    with pytest.raises(permits.KeyInUse):
        client.acquire(f"{ns}s", key=f"{ns}k", new_only=True, timeout=1)
    client.release(first)
    client.release(other)
    with pytest.raises(permits.KeyInUse) as refused:
        client.acquire(f"{ns}s", key=f"{ns}k", new_only=True)
    assert refused.value.details["held"] is False
    assert client.get_semaphore(f"{ns}s").used == 0
    with pytest.raises(permits.InvalidArgument):
        client.acquire(f"{ns}s", new_only="yes")


def test_a_retry_of_a_request_for_a_new_lease_only_gets_its_own_lease_back(client: Any, ns: str) -> None:
    """A ``new_only`` request's tries share its ``request_id``, which its lease records: a retry after a lost
    reply (here, the same id sent again) is answered with that lease, with room left and without, while a
    request under another id, or none, is refused. For one semaphore and for several: each grant statement
    records it."""
    a, b = f"{ns}a", f"{ns}b"
    client.create_semaphore(a, 2)
    client.create_semaphore(b, 2)
    for shape, wants in (("one", {a: 1}), ("many", {a: 1, b: 1})):
        key = f"{ns}{shape}"
        first = client.acquire(wants, key=key, new_only=True, request_id=f"r-{shape}")
        # With room: the retry's grant meets the key's lease (a duplicate key), and is answered with it.
        assert client.acquire(wants, key=key, new_only=True, request_id=f"r-{shape}").tokens == first.tokens
        filler = client.acquire(wants)
        # Without room: the refusal finds the key's lease, and answers with it.
        assert client.try_acquire(wants, key=key, new_only=True, request_id=f"r-{shape}").tokens == first.tokens
        for other in ("r-other", None):
            with pytest.raises(permits.KeyInUse):
                client.acquire(wants, key=key, new_only=True, request_id=other, timeout=0)
        client.release(filler)
        client.release(first)
        with pytest.raises(permits.LeaseLost):  # its own, but ended: never handed out again
            client.acquire(wants, key=key, new_only=True, request_id=f"r-{shape}")
        assert client.get_semaphore(a).used == 0
    assert client.acquire(a, key=f"{ns}plain", request_id="ignored").key == f"{ns}plain"  # without new_only
    for bad in ("", "x" * 65, 7):
        with pytest.raises(permits.InvalidArgument):
            client.acquire(a, key=f"{ns}bad", new_only=True, request_id=bad)
    assert client.get_semaphore(a).used == 1


def test_a_release_by_request_id_releases_only_the_lease_that_request_got(client: Any, ns: str) -> None:
    """``release(key, request_id=...)`` ends the lease under the key only if that request got it: a lease
    that records another request's id, or none, is left alone and the answer is ``NOT_FOUND``."""
    a, b = f"{ns}a", f"{ns}b"
    client.create_semaphore(a, 2)
    client.create_semaphore(b, 2)
    own = client.acquire({a: 1, b: 1}, key=f"{ns}own", new_only=True, request_id="r-1")
    plain = client.acquire(a, key=f"{ns}plain")
    assert client.release(f"{ns}own", request_id="r-2") is permits.ReleaseOutcome.NOT_FOUND
    assert client.release(f"{ns}plain", request_id="r-1") is permits.ReleaseOutcome.NOT_FOUND
    assert client.release(f"{ns}none", request_id="r-1") is permits.ReleaseOutcome.NOT_FOUND
    assert client.get_semaphore(a).used == 2 and client.get_semaphore(b).used == 1
    assert client.release(f"{ns}own", request_id="r-1") is permits.ReleaseOutcome.RELEASED
    assert client.release(own, request_id="r-1") is permits.ReleaseOutcome.ALREADY_RELEASED
    assert client.get_semaphore(a).used == 1 and client.get_semaphore(b).used == 0
    for bad in ("", "x" * 65, 7):
        with pytest.raises(permits.InvalidArgument):
            client.release(plain, request_id=bad)
    assert client.release(plain) is permits.ReleaseOutcome.RELEASED
    assert client.reconcile() == []


def test_released_key_is_not_granted_again(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 1)
    lease = client.try_acquire(f"{ns}s", key=f"{ns}once")
    client.release(lease)
    with pytest.raises(permits.LeaseLost) as lost:
        client.try_acquire(f"{ns}s", key=f"{ns}once")  # a late retry must not grant again
    assert lost.value.reason == "released"
    assert client.get_semaphore(f"{ns}s").used == 0


def test_keys_are_scoped_by_owner(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 2)
    mine = client.try_acquire(f"{ns}s", key=f"{ns}shared-key", owner="alice")
    theirs = client.try_acquire(f"{ns}s", key=f"{ns}shared-key", owner="bob")
    assert mine.token != theirs.token and (mine.owner, theirs.owner) == ("alice", "bob")
    assert client.release(f"{ns}shared-key", owner="bob") == ReleaseOutcome.RELEASED
    assert client.get_lease(f"{ns}shared-key", owner="alice").held


def test_extend(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 1)
    lease = client.try_acquire(f"{ns}s", ttl=2)
    extended = client.extend(lease, 120)
    assert 119 <= extended.expires_in <= 120 and extended.tokens == lease.tokens
    assert client.extend(lease.key).expires_in <= 2  # the lease's own TTL, not the last extend's
    client.release(lease)
    with pytest.raises(permits.LeaseLost):
        client.extend(lease, 10)
    with pytest.raises(permits.LeaseNotFound):
        client.extend(f"{ns}no-such-key", 10)


def test_an_extend_without_a_ttl_renews_by_the_leases_own(make_client: Any, ns: str) -> None:
    """Whichever client sends it: the TTL is the lease's, kept by the database, not the extending client's."""
    holder, other = make_client(owner=f"{ns}o", ttl=5), make_client(owner=f"{ns}o", ttl=7)
    holder.create_semaphore(f"{ns}s", 2)
    lease = holder.acquire(f"{ns}s", key=f"{ns}k", ttl=300)
    assert lease.ttl == 300 and other.get_lease(lease.key).ttl == 300
    assert 299 <= other.extend(lease.key).expires_in <= 300
    assert 299 <= holder.extend(lease).expires_in <= 300
    # One given changes the expiry, not the lease's TTL (a watchdog's extends must not leave theirs behind).
    assert 89 <= other.extend(lease.key, 90).expires_in <= 90
    assert 299 <= holder.extend(lease).expires_in <= 300
    # A grant at the client's default TTL keeps that one.
    short = holder.acquire(f"{ns}s", key=f"{ns}k2")
    assert 4 <= other.extend(short).expires_in <= 5


def test_a_lease_granted_before_leases_kept_their_ttl_is_extended_by_the_default(
    make_client: Any, db_url: str, via: str, ns: str
) -> None:
    """A lease an older permits granted (before migration 0008) has no TTL of its own: an extend without one
    gives it the extending client's default, through a service the service's, as every extend did before."""
    from sqlalchemy import create_engine, text

    from tests.conftest import sqlalchemy_url

    holder = make_client(owner=f"{ns}o", ttl=7)
    holder.create_semaphore(f"{ns}s", 1)
    lease = holder.acquire(f"{ns}s", key=f"{ns}k", ttl=300)
    engine = create_engine(sqlalchemy_url(db_url))
    with engine.begin() as conn:  # as an older permits wrote it
        conn.execute(
            text("UPDATE permits_lease SET ttl_ms = NULL WHERE owner = :o AND lease_key = :k"),
            {"o": f"{ns}o", "k": f"{ns}k"},
        )
    engine.dispose()
    default = 7 if via == "db" else permits.DEFAULT_TTL
    assert default - 1 <= holder.extend(lease).expires_in <= default
    # ... which is its TTL from then on.
    assert default - 1 <= holder.extend(lease).expires_in <= default


def test_expired_lease_never_blocks(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 1)
    old = client.try_acquire(f"{ns}s", ttl=0.3)
    assert client.try_acquire(f"{ns}s") is None
    time.sleep(0.5)
    with pytest.raises(permits.LeaseLost) as lost:
        client.extend(old, 10)
    assert lost.value.reason == "expired"
    # The acquire that needs the room reclaims the expired lease in its own transaction.
    new = client.try_acquire(f"{ns}s")
    assert new is not None and new.token > old.token
    assert client.get_lease(old.key).end_reason == EndReason.EXPIRED
    assert client.release(old) == ReleaseOutcome.LOST
    assert client.get_semaphore(f"{ns}s").used == 1


def test_release_after_expiry_reports_lost(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 1)
    lease = client.try_acquire(f"{ns}s", ttl=0.2)
    time.sleep(0.4)
    assert client.release(lease) == ReleaseOutcome.LOST
    assert client.get_semaphore(f"{ns}s").used == 0
    assert client.get_lease(lease.key).end_reason == EndReason.EXPIRED


def test_sweep(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 5)
    short = [client.try_acquire(f"{ns}s", ttl=0.2) for _ in range(3)]
    keep = client.try_acquire(f"{ns}s", ttl=60)
    time.sleep(0.4)
    result = client.sweep(batch_size=2)
    swept = {key for owner, key in result.keys}
    assert {lease.key for lease in short} <= swept and keep.key not in swept
    assert all(client.get_lease(lease.key).end_reason == EndReason.SWEPT for lease in short)
    assert client.get_semaphore(f"{ns}s").used == 1
    assert client.reconcile() == []


def test_a_sweep_with_a_timeout_starts_no_batch_after_it_and_says_it_is_incomplete(client: Any, ns: str) -> None:
    """With ``timeout``, the sweep's first batch runs, and no other starts once the time is up: the result
    says the sweep was not complete (as ``max_batches`` ending it does), and the next sweep finishes it.
    Through the service the time left goes with the request, and the service holds to it."""
    client.create_semaphore(f"{ns}s", 5)
    short = {client.try_acquire(f"{ns}s", ttl=0.2).key for _ in range(4)}
    keep = client.try_acquire(f"{ns}s", ttl=60)
    time.sleep(0.4)
    first = client.sweep(batch_size=1, timeout=0)
    assert (first.leases, first.batches, first.complete) == (1, 1, False), first
    capped = client.sweep(batch_size=1, max_batches=2)
    assert (capped.leases, capped.batches, capped.complete) == (2, 2, False), capped
    rest = client.sweep(batch_size=1, timeout=30)
    assert rest.complete and rest.leases >= 1, rest
    swept = {key for result in (first, capped, rest) for _, key in result.keys}
    assert short <= swept and keep.key not in swept
    assert client.sweep(timeout=30) == permits.SweepResult(complete=True)
    assert client.get_semaphore(f"{ns}s").used == 1
    assert client.reconcile(timeout=30) == []


def test_revoke_ends_the_lease_with_its_reason(make_client: Any, ns: str) -> None:
    admin, holder = make_client(owner=f"{ns}admin"), make_client(owner=f"{ns}worker")
    admin.create_semaphore(f"{ns}s", 1)
    lease = holder.acquire(f"{ns}s", ttl=60)
    revoked = admin.revoke(lease.key, owner=f"{ns}worker", reason="stuck since the deploy")
    assert revoked.end_reason == EndReason.REVOKED and revoked.end_note == "stuck since the deploy"
    assert not revoked.held and revoked.tokens == lease.tokens
    assert admin.get_semaphore(f"{ns}s").used == 0  # its permits came back at once
    with pytest.raises(permits.LeaseLost) as lost:
        holder.extend(lease, 60)
    assert lost.value.reason == "revoked"
    assert holder.release(lease) == ReleaseOutcome.LOST
    # Revoking again changes nothing; an unknown lease is not found.
    assert admin.revoke(lease.key, owner=f"{ns}worker", reason="again").end_note == "stuck since the deploy"
    with pytest.raises(permits.LeaseNotFound):
        admin.revoke(f"{ns}never", owner=f"{ns}worker", reason="x")
    with pytest.raises(permits.InvalidArgument):
        admin.revoke(lease.key, owner=f"{ns}worker", reason="\x00")
    assert admin.reconcile() == []


def test_revokes_at_once_all_answer_the_ended_lease(make_client: Any, ns: str) -> None:
    """Each revoke answers the lease as it is once revoked, also the ones that lost the race to end it (on
    MariaDB their reads kept the snapshot of before, which showed it held), and an expired lease that no
    sweep has ended yet is left as it is rather than relabelled."""
    admin = make_client(owner=f"{ns}admin")
    holder = make_client(owner=f"{ns}worker")
    admin.create_semaphore(f"{ns}s", 1)
    clients = [make_client(owner=f"{ns}admin") for _ in range(4)]

    def revoke(client: Any, key: str, start: threading.Barrier, answers: list[Any]) -> None:
        start.wait()
        answers.append(client.revoke(key, owner=f"{ns}worker", reason="race"))

    for round_ in range(3):
        lease = holder.acquire(f"{ns}s", key=f"{ns}k{round_}", ttl=60)
        answers: list[Any] = []
        start = threading.Barrier(len(clients))
        threads = [threading.Thread(target=revoke, args=(c, lease.key, start, answers)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(answers) == len(clients)
        assert all(a.end_reason == EndReason.REVOKED and not a.held for a in answers), answers
    short = holder.acquire(f"{ns}s", key=f"{ns}short", ttl=0.2)
    time.sleep(0.5)
    left = admin.revoke(short.key, owner=f"{ns}worker", reason="too late")
    assert left.end_reason is None and not left.held and left.end_note is None


def test_holders(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 5)
    a = client.try_acquire({f"{ns}s": 2}, key=f"{ns}a", owner="alice")
    b = client.try_acquire({f"{ns}s": 1}, key=f"{ns}b", owner="bob")
    holders = client.holders(f"{ns}s")
    assert [(h.owner, h.key, h.count, h.token) for h in holders] == [
        ("alice", f"{ns}a", 2, a.token),
        ("bob", f"{ns}b", 1, b.token),
    ]
    assert all(h.expires_in > 0 for h in holders)
    client.release(a)
    assert [h.key for h in client.holders(f"{ns}s")] == [f"{ns}b"]


def test_acquire_waits_then_times_out(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 1)
    client.try_acquire(f"{ns}s")
    started = time.monotonic()
    with pytest.raises(permits.AcquireTimeout):
        client.acquire(f"{ns}s", timeout=0.5)
    assert 0.45 <= time.monotonic() - started < 3


def test_acquire_waits_for_a_release(make_client: Any, ns: str) -> None:
    holder, waiter = make_client(), make_client()
    holder.create_semaphore(f"{ns}s", 1)
    lease = holder.try_acquire(f"{ns}s")
    timer = threading.Timer(0.4, holder.release, args=(lease,))
    timer.start()
    got = waiter.acquire(f"{ns}s", timeout=10)
    timer.join()
    assert got.token > lease.token


def test_an_infinite_timeout_waits_for_ever(make_client: Any, ns: str) -> None:
    """``math.inf`` is for ever, as ``None`` is (trio's and anyio's deadlines take it): not refused as a
    number that is not finite."""
    holder, waiter = make_client(), make_client()
    holder.create_semaphore(f"{ns}s", 1)
    lease = holder.try_acquire(f"{ns}s")
    timer = threading.Timer(0.4, holder.release, args=(lease,))
    timer.start()
    got = waiter.acquire(f"{ns}s", timeout=math.inf)
    timer.join()
    assert got.token > lease.token
    assert waiter.release(got) is ReleaseOutcome.RELEASED
    with waiter.lease(f"{ns}s", key=f"{ns}forever", timeout=math.inf, max_hold=math.inf) as held:
        assert held.held


def test_context_manager_releases(client: Any, ns: str) -> None:
    client.create_semaphore(f"{ns}s", 1)
    with client.lease(f"{ns}s", ttl=10) as lease:
        assert client.get_semaphore(f"{ns}s").used == 1
        assert client.get_lease(lease.key).held
    assert client.get_semaphore(f"{ns}s").used == 0
    with pytest.raises(RuntimeError), client.lease(f"{ns}s"):
        raise RuntimeError("the body failed")
    assert client.get_semaphore(f"{ns}s").used == 0


def test_mutex(client: Any, ns: str) -> None:
    client.create_mutex(f"{ns}m")
    assert client.get_semaphore(f"{ns}m").capacity == 1
    with client.mutex(f"{ns}m") as lease:
        assert client.try_acquire(f"{ns}m") is None
        assert lease.counts == {f"{ns}m": 1}
    assert client.try_acquire(f"{ns}m") is not None


def test_reconcile_finds_and_repairs_drift(client: Any, db_url: str, ns: str) -> None:
    from sqlalchemy import create_engine, text

    from tests.conftest import sqlalchemy_url

    client.create_semaphore(f"{ns}s", 5)
    client.try_acquire({f"{ns}s": 2})
    assert client.reconcile() == []
    url = sqlalchemy_url(db_url)
    engine = create_engine(url)
    with engine.begin() as conn:  # damage the count behind permits' back
        conn.execute(text("UPDATE permits_semaphore SET used = 4 WHERE name = :n"), {"n": f"{ns}s"})
    engine.dispose()
    drift = [d for d in client.reconcile() if d.name == f"{ns}s"]
    assert [(d.recorded, d.actual, d.repaired) for d in drift] == [(4, 2, False)]
    repaired = [d for d in client.reconcile(repair=True) if d.name == f"{ns}s"]
    assert [(d.recorded, d.actual, d.repaired) for d in repaired] == [(4, 2, True)]
    assert client.get_semaphore(f"{ns}s").used == 2
    assert [d for d in client.reconcile() if d.name == f"{ns}s"] == []


def test_a_repair_with_a_timeout_starts_none_after_it_and_reports_the_drift_left(
    client: Any, db_url: str, ns: str
) -> None:
    """``reconcile(repair=True, timeout=...)``: no repair starts once the time is up, and the drift left is
    reported as found (not repaired); nothing is changed by it, and a repair with time enough fixes it all."""
    from sqlalchemy import create_engine, text

    from tests.conftest import sqlalchemy_url

    names = [f"{ns}a", f"{ns}b"]
    for name in names:
        client.create_semaphore(name, 5)
        client.try_acquire({name: 2})
    engine = create_engine(sqlalchemy_url(db_url))
    with engine.begin() as conn:  # damage the counts behind permits' back
        damage = text("UPDATE permits_semaphore SET used = 4 WHERE name IN (:a, :b)")
        conn.execute(damage, {"a": names[0], "b": names[1]})
    engine.dispose()
    left = sorted((d.name, d.recorded, d.actual, d.repaired) for d in client.reconcile(repair=True, timeout=0))
    assert [row for row in left if row[0] in names] == [(name, 4, 2, False) for name in names]
    assert [client.get_semaphore(name).used for name in names] == [4, 4]
    repaired = [d for d in client.reconcile(repair=True, timeout=30) if d.name in names]
    assert sorted((d.name, d.repaired) for d in repaired) == [(name, True) for name in names]
    assert [client.get_semaphore(name).used for name in names] == [2, 2]


def test_reconcile_raises_a_lagging_token_counter(client: Any, db_url: str, ns: str) -> None:
    """A token counter behind the permit rows (what a half-committed grant on Galera left, see
    docs/deployment.md) would make every grant meet a token already handed out. reconcile finds it and
    repair raises the counter; it never lowers one."""
    from sqlalchemy import create_engine, text

    from tests.conftest import sqlalchemy_url

    name = f"{ns}t"
    client.create_semaphore(name, 3)
    for _ in range(3):
        client.release(client.try_acquire(name))
    held = client.try_acquire(name)
    assert held.token == 4
    url = sqlalchemy_url(db_url)
    engine = create_engine(url)
    with engine.begin() as conn:  # damage the counter behind permits' back
        conn.execute(text("UPDATE permits_semaphore SET last_token = 2 WHERE name = :n"), {"n": name})
    engine.dispose()
    drift = [d for d in client.reconcile() if d.name == name]
    assert [(d.field, d.recorded, d.actual, d.repaired) for d in drift] == [("last_token", 2, 4, False)]
    repaired = [d for d in client.reconcile(repair=True) if d.name == name]
    assert [(d.field, d.recorded, d.actual, d.repaired) for d in repaired] == [("last_token", 2, 4, True)]
    assert client.get_semaphore(name).last_token == 4
    assert client.try_acquire(name).token == 5  # the next grant is not refused as a duplicate
    assert [d for d in client.reconcile() if d.name == name] == []


def _expired_places_past_the_ticket_counter(db_url: str, name: str, after: list[int]) -> list[int]:
    """Expired places in ``name``'s fair queue, behind permits' back, on the tickets ``after`` the last one
    handed out (a restore of the semaphore rows older than the queue's, or a hand edit); their tickets."""
    from sqlalchemy import create_engine, text

    from tests.conftest import sqlalchemy_url

    engine = create_engine(sqlalchemy_url(db_url))
    # PostgreSQL's counter is one sequence; one never called yet hands out its last_value next
    sequence = "(SELECT last_value - 1 + is_called::int FROM permits_ticket)"
    counter = sequence if engine.dialect.name == "postgresql" else "last_ticket"
    with engine.begin() as conn:
        sem_id, last = conn.execute(
            text(f"SELECT id, {counter} FROM permits_semaphore WHERE name = :n"), {"n": name}
        ).one()
        tickets = [int(last) + n for n in after]
        for ticket in tickets:
            conn.execute(
                text(
                    "INSERT INTO permits_waiter (semaphore_id, ticket, owner, lease_key, count, enqueued_at_ms,"
                    " expires_at_ms) VALUES (:s, :t, 'gone', :k, 1, 1, 2)"
                ),
                {"s": sem_id, "t": ticket, "k": f"{name}-{ticket}"},
            )
    engine.dispose()
    return tickets


def test_reconcile_raises_a_lagging_ticket_counter(client: Any, db_url: str, ns: str) -> None:
    """A fair queue's ticket counter behind a place's ticket would give a waiter a ticket a place holds
    (see the next test). reconcile finds it and repair raises the counter (PostgreSQL's is one sequence for
    every semaphore); it never lowers one."""
    name = f"{ns}q"
    client.create_semaphore(name, 1, fair=True)
    held = client.try_acquire(name)
    [ahead] = _expired_places_past_the_ticket_counter(db_url, name, [1000])
    found = [(d.field, d.actual, d.repaired) for d in client.reconcile() if d.name == name]
    assert found == [("last_ticket", ahead, False)]
    repaired = [d for d in client.reconcile(repair=True) if d.name == name]
    assert [(d.field, d.actual, d.repaired) for d in repaired] == [("last_ticket", ahead, True)]
    assert repaired[0].recorded < ahead
    assert [d for d in client.reconcile() if d.name == name] == []
    with pytest.raises(permits.AcquireTimeout):  # a wait takes a place (a new ticket) again
        client.acquire(name, timeout=0.3)
    client.release(held)
    client.release(client.acquire(name, timeout=5))


def test_a_wait_heals_a_ticket_counter_behind_its_queue(client: Any, db_url: str, ns: str) -> None:
    """Where a fair queue's ticket counter is behind a place's ticket, the wait that meets that place's key
    raises the counter past it and takes a place; before, every try met the same key again (the refused
    enqueue rolled its ticket back, on MariaDB and SQLite) and the wait ended in "an operation kept
    restarting"."""
    name = f"{ns}h"
    client.create_semaphore(name, 1, fair=True)
    held = client.try_acquire(name)
    # more than a wait's restarts (PostgreSQL's sequence would walk past a few, one restart each)
    _expired_places_past_the_ticket_counter(db_url, name, list(range(1, MAX_RESTARTS + 3)))
    with pytest.raises(permits.AcquireTimeout):  # it waited in the queue, rather than giving up at once
        client.acquire(name, timeout=0.5)
    client.release(held)
    client.release(client.acquire(name, timeout=5))
    assert [d for d in client.reconcile() if d.name == name] == []


def test_reconcile_removes_permit_rows_without_a_lease(client: Any, db_url: str, ns: str) -> None:
    """A permit row whose lease is gone (the other half of the Galera batch bug) counts nothing held, but a
    lease that one day reused its id would inherit it. reconcile reports it; repair deletes it, and raises
    the token counter past it first, so its token stays spent."""
    from sqlalchemy import create_engine, text

    from tests.conftest import sqlalchemy_url

    name = f"{ns}o"
    client.create_semaphore(name, 2)
    held = client.try_acquire(name)
    url = sqlalchemy_url(db_url)
    engine = create_engine(url)
    with engine.begin() as conn:  # a permit with token 2 whose lease never committed
        sem_id = conn.execute(text("SELECT id FROM permits_semaphore WHERE name = :n"), {"n": name}).scalar()
        conn.execute(
            text("INSERT INTO permits_permit (lease_id, semaphore_id, count, token) VALUES (:l, :s, 1, 2)"),
            {"l": 10**12 + 7, "s": sem_id},
        )
    drift = sorted((d.field, d.recorded, d.actual) for d in client.reconcile() if d.name == name)
    assert drift == [("last_token", 1, 2), ("orphaned_permits", 1, 0)]
    repaired = sorted((d.field, d.repaired) for d in client.reconcile(repair=True) if d.name == name)
    assert repaired == [("last_token", True), ("orphaned_permits", True)]
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT token FROM permits_permit WHERE semaphore_id = :s"), {"s": sem_id}).all()
    engine.dispose()
    assert [r[0] for r in rows] == [held.token]  # the held lease's permit is untouched
    assert client.try_acquire(name).token == 3
    assert [d for d in client.reconcile() if d.name == name] == []
