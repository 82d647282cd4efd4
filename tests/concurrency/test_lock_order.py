"""Every statement that locks several semaphore rows locks them in name order, so a give-back and a grant
over the same semaphores never wait on each other in a cycle. Real servers, several connections.

Grants lock in name order. A release (or a revoke, or a sweep) used to lock in whatever order its plan read
the lease's permits: semaphore-id order with an index plan, that is, the order the semaphores were created
in. With two semaphores made out of name order ("a global limit plus a per-tenant limit"), a release and a
grant over both could deadlock: PostgreSQL breaks the cycle only after ``deadlock_timeout`` (1 s by
default), and one of the two then starts again. MariaDB breaks it at once, but the victim still starts over.
MariaDB's one-statement release is the exception that remains (see the test).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

import permits
from tests._service import running
from tests.conftest import count_function_calls, function_calls, mariadb_session, own_database

pytestmark = [pytest.mark.usefixtures("servers")]


@pytest.fixture(params=["postgresql", "mysql"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    with own_database(request.param, "permits_order") as made:
        if request.param == "postgresql":
            # An index plan reads a lease's permits in semaphore-id order: the order that crossed the grants'.
            # (The default plan here, a bitmap scan, happens to read them in the order the grant wrote them.)
            with psycopg.connect(made.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
                conn.execute(f"ALTER DATABASE {make_url(made).database} SET enable_bitmapscan = off")
        yield made


def _blocker(url: str) -> Any:
    """A plain driver connection in a transaction of its own, to hold a semaphore's row."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        return psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
    return mariadb_session(url)


@contextlib.contextmanager
def _row_held(url: str, name: str) -> Iterator[None]:
    """Semaphore ``name``'s row locked by another transaction, as a release or a grant in flight holds it."""
    blocker = _blocker(url)
    try:
        blocker.cursor().execute("SELECT 1 FROM permits_semaphore WHERE name = %s FOR UPDATE", (name,))
        yield
    finally:
        blocker.rollback()
        blocker.close()


def _lined_up(url: str, row: str, *calls: tuple[str, Callable[[], Any]]) -> tuple[dict[str, Any], dict[str, float]]:
    """With semaphore ``row``'s row held by another transaction, start each call in a thread of its own,
    0.3 s apart (the first waits for the row, the next behind or beside it), then let the row go. Returns
    each call's answer (``SemaphoreNotFound`` is one too), and how many seconds after the row was let go
    each came back. Any other error fails the test."""
    answers: dict[str, Any] = {}
    done: dict[str, float] = {}
    errors: list[BaseException] = []

    def run(what: str, call: Callable[[], Any]) -> None:
        try:
            answers[what] = call()
        except permits.SemaphoreNotFound as gone:
            answers[what] = gone
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            return
        done[what] = time.monotonic()

    threads = []
    with _row_held(url, row):
        for what, call in calls:
            threads.append(threading.Thread(target=run, args=(what, call)))
            threads[-1].start()
            time.sleep(0.3)
        let_go = time.monotonic()
    for thread in threads:
        thread.join(10)
    assert not errors, errors
    assert set(done) == {what for what, _ in calls}, done
    return answers, {what: round(at - let_go, 3) for what, at in done.items()}


def _deadlocks(url: str) -> int:
    """The server's count of deadlocks it has broken (PostgreSQL: in this database)."""
    conn = _blocker(url)
    try:
        cur = conn.cursor()
        if make_url(url).get_backend_name() == "postgresql":
            conn.autocommit = True
            cur.execute("SELECT pg_stat_clear_snapshot()")
            cur.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        else:
            cur.execute("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")
            return int(cur.fetchone()[1])
        return int(cur.fetchone()[0])
    finally:
        conn.close()


GIVE_BACKS: dict[str, Callable[[permits.Client, permits.Lease], Any]] = {
    "release": lambda client, lease: client.release(lease),
    "release-by-key": lambda client, lease: client.release(lease.key),
    "revoke": lambda client, lease: client.revoke(lease, reason="lock order test"),
}


@pytest.mark.parametrize("give_back", list(GIVE_BACKS))
def test_a_give_back_and_a_grant_over_the_same_semaphores_never_deadlock(ns: str, url: str, give_back: str) -> None:
    """``b`` is made before ``a``, so id order and name order cross. A third connection holds ``b``'s row;
    a give-back of a lease over both starts, then a grant over both. When the row is let go, both go
    through at once, and the server broke no deadlock. Locking in id order, the give-back took ``b`` and
    waited for ``a``, which the grant held while it waited for ``b``: on PostgreSQL both stalled for a
    second."""
    a, b = f"{ns}a", f"{ns}b"
    with permits.connect(url, auto_upgrade=True) as client:
        client.create_semaphore(b, 2)
        client.create_semaphore(a, 2)
        held = client.acquire({a: 1, b: 1}, timeout=5)
        before = _deadlocks(url)
        # The give-back waits for b's row; the grant too, holding whatever it could lock before.
        _, took = _lined_up(
            url,
            b,
            ("give_back", lambda: GIVE_BACKS[give_back](client, held)),
            ("grant", lambda: client.try_acquire({a: 1, b: 1})),
        )
        assert max(took.values()) < 0.5, took
        broken = _deadlocks(url) - before
        if make_url(url).get_backend_name() == "mysql" and give_back.startswith("release"):
            # MariaDB's release is one multi-table UPDATE, which locks the rows in the order its join reads
            # them and takes no ORDER BY, and a locking read cannot lock in sorted order there. InnoDB breaks
            # the cycle the moment it forms, and the one it rolled back starts over: no stall (above).
            assert broken <= 1
        else:
            assert broken == 0
        assert client.get_semaphore(a).used == 1
        assert client.get_semaphore(b).used == 1
        assert client.reconcile() == []


def test_a_grant_over_several_semaphores_locks_their_rows_only(ns: str, url: str) -> None:
    """Another transaction holds the row of a semaphore the grant does not want: the grant goes through at
    once. On MariaDB the grant's locking read joins the wants to the semaphores through their name index,
    a plan its hints pin: on a table of a few rows the optimizer chose a full scan, which locks every row it
    reads, and the grant then waited for the unrelated row."""
    a, b, c = f"{ns}a", f"{ns}b", f"{ns}c"
    with permits.connect(url, auto_upgrade=True) as client:
        for name in (a, b, c):
            client.create_semaphore(name, 2)
        with _row_held(url, c):
            started = time.monotonic()
            lease = client.try_acquire({a: 1, b: 1})
            took = time.monotonic() - started
        assert lease is not None and set(lease.tokens) == {a, b}
        assert took < 0.5, took
        client.release(lease)
        assert client.reconcile() == []


def test_a_refused_grant_over_several_semaphores_waits_for_no_row(ns: str, url: str) -> None:
    """``b`` is full, and another transaction holds its row (a release or a grant in flight). A grant over
    ``a`` and ``b`` is refused at once: a read that locks nothing finds there is no room before any row is
    locked, so the refusal neither waits for ``b``'s row nor holds ``a``'s."""
    a, b = f"{ns}a", f"{ns}b"
    with permits.connect(url, auto_upgrade=True) as client:
        client.create_semaphore(a, 1)
        client.create_semaphore(b, 1)
        full = client.acquire(b, timeout=5)
        with _row_held(url, b):
            started = time.monotonic()
            refused = client.try_acquire({a: 1, b: 1})
            took = time.monotonic() - started
            lease = client.try_acquire(a)  # a's row is free
        assert refused is None
        assert took < 0.5, took
        assert lease is not None
        client.release(lease)
        client.release(full)
        assert client.reconcile() == []


def test_where_the_lease_is_known_to_be_over_one_semaphore_the_release_skips_the_ordering_step(ns: str) -> None:
    """RELEASE's ordering step costs (docs/benchmarks.md), and one row cannot be part of a cycle: a release
    that knows its lease is over one semaphore sends RELEASE_ONE. The library knows from the Lease it is
    given, a held block from the lease it took, and the service from the leases it granted (a remote
    client releases by key). A release by key of a lease nobody here granted takes the ordered form. Counted
    as server functions (``?pooler=transaction``), which the service's process calls too."""
    with own_database("postgresql", "permits_order") as url:
        count_function_calls(url)
        pooled = url + "?pooler=transaction"
        with permits.connect(pooled, auto_upgrade=True) as client:
            client.create_semaphore(f"{ns}a", 2)
            client.create_semaphore(f"{ns}b", 2)
            client.release(client.acquire(f"{ns}a", timeout=5))
            with client.lease(f"{ns}a", timeout=5):
                pass
            with client.lease({f"{ns}a": 1, f"{ns}b": 1}, timeout=5):
                pass
            one = client.acquire(f"{ns}a", timeout=5)
            client.release(one.key)
        by_key_of_one, of_two = 1, 1
        with running(pooled) as service, permits.connect(service.url) as remote:
            remote.release(remote.acquire(f"{ns}a", timeout=5))  # over HTTP: by key
            remote.release(remote.acquire({f"{ns}a": 1, f"{ns}b": 1}, timeout=5))
        calls = function_calls(url)
    assert calls.get("release_one") == 2 + 1, calls  # two in the library, one through the service
    assert calls.get("release") == by_key_of_one + of_two + 1, calls


def test_a_grant_that_reclaims_expired_leases_and_a_release_never_deadlock(ns: str, url: str) -> None:
    """Expired leases never block a grant: a refused one ends those holding its semaphores, and gives their
    permits back, before it asks again. It used to do so while it held its own semaphore rows: having
    locked ``b``, it gave back to ``a`` too, lower in name order, while a release of another lease over both
    held ``a`` and waited for ``b``. It now ends them in a transaction of its own first."""
    a, b = f"{ns}a", f"{ns}b"
    with permits.connect(url, auto_upgrade=True) as client:
        client.create_semaphore(a, 2)
        client.create_semaphore(b, 2)
        client.acquire({a: 1, b: 1}, ttl=0.2, timeout=5)  # left to expire, as by a crashed holder
        held = client.acquire({a: 1, b: 1}, timeout=5)
        time.sleep(0.4)
        before = _deadlocks(url)
        # The release waits for a's row; the grant finds b full, and the expired lease.
        answers, took = _lined_up(
            url, a, ("release", lambda: client.release(held)), ("grant", lambda: client.try_acquire(b))
        )
        assert max(took.values()) < 0.5, took
        assert _deadlocks(url) == before
        lease = answers["grant"]
        assert set(lease.tokens) == {b}
        client.release(lease)
        assert client.get_semaphore(a).used == 0 and client.get_semaphore(b).used == 0
        assert client.reconcile() == []


def test_a_grant_that_waited_for_a_row_sees_the_fair_queue_as_it_is_after_the_wait(ns: str) -> None:
    """MariaDB. A grant over a fair semaphore and another one waits for the fair one's row while a waiter
    takes its place in that semaphore's queue (its ticket locks the row) and commits. The grant must then
    see that place and wait behind it, as a grant of the fair semaphore alone does. Its first, lock-free
    read had fixed the transaction's snapshot, and a plain read of the queue inside the locking one read
    that snapshot: the grant went ahead of the waiter. (PostgreSQL reads the queue as of the statement's
    start, for one semaphore as for several: docs/design.md.)"""
    fair, other = f"{ns}f", f"{ns}g"
    with own_database("mysql", "permits_order") as url, permits.connect(url, auto_upgrade=True) as client:
        client.create_semaphore(fair, 1, fair=True)
        client.create_semaphore(other, 5)
        enqueuer = _blocker(url)
        try:
            cur = enqueuer.cursor()
            cur.execute("SELECT id FROM permits_semaphore WHERE name = %s FOR UPDATE", (fair,))
            (fair_id,) = cur.fetchone()
            answer: list[Any] = []
            asking = threading.Thread(target=lambda: answer.append(client.try_acquire({fair: 1, other: 1})))
            asking.start()
            time.sleep(0.4)  # the grant waits for the fair semaphore's row
            cur.execute("UPDATE permits_semaphore SET last_ticket = last_ticket + 1 WHERE id = %s", (fair_id,))
            cur.execute(
                "INSERT INTO permits_waiter"
                " (semaphore_id, ticket, owner, lease_key, count, enqueued_at_ms, expires_at_ms)"
                " VALUES (%s, 1, 'w', 'W', 1, 0, CAST(UNIX_TIMESTAMP(NOW(6)) * 1000 AS SIGNED) + 60000)",
                (fair_id,),
            )
            enqueuer.commit()
            asking.join(10)
        finally:
            enqueuer.close()
        assert answer == [None], answer
        assert client.get_semaphore(fair).used == 0


def test_a_refused_grant_reclaims_once_where_leases_keep_expiring(ns: str, url: str) -> None:
    """``a`` is held; ``b`` has room, and leases on it expire every few milliseconds. A grant over both is
    refused, as often as it is asked: it reclaims at most once per attempt, and only on the semaphores
    that lack room. It went on reclaiming, and every attempt failed with "an operation kept restarting"."""
    a, b = f"{ns}a", f"{ns}b"
    with permits.connect(url, auto_upgrade=True) as client:
        client.create_semaphore(a, 1)
        client.create_semaphore(b, 1000)
        held = client.acquire(a, timeout=5)
        # The leases expire 4 ms apart from ``first_expiry``, set after the time their acquires take on this
        # machine: a fixed 0.3 s would give a negative TTL where an acquire takes over 6 ms (a slow disk's
        # commit), and let most of them expire before the asking began where it takes 4 ms.
        timed = time.monotonic()
        for _ in range(5):
            client.release(client.acquire(b, timeout=5))
        per_acquire = (time.monotonic() - timed) / 5
        started = time.monotonic()
        first_expiry = started + 0.3 + 2 * 150 * per_acquire
        for i in range(150):
            client.acquire(b, ttl=first_expiry + 0.004 * i - time.monotonic(), timeout=5)
        assert time.monotonic() < first_expiry, "the leases were not all taken before the first expired"
        time.sleep(max(0.0, first_expiry - 0.1 - time.monotonic()))
        asked = 0
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:
            assert client.try_acquire({a: 1, b: 1}) is None
            asked += 1
        assert asked >= 10
        client.release(held)


def test_a_forced_delete_and_a_grant_over_the_semaphore_and_another_never_deadlock(ns: str, url: str) -> None:
    """A lease over ``c`` and ``d`` is held, and ``d`` is deleted with ``force``. The delete ends that lease
    before it locks ``d`` for good: it used to end it under ``d``'s row lock, giving back to ``c`` after
    ``d``, while a grant over both held ``c`` and waited for ``d``."""
    c, d = f"{ns}c", f"{ns}d"
    with permits.connect(url, auto_upgrade=True) as client:
        client.create_semaphore(c, 2)
        client.create_semaphore(d, 2)
        client.acquire({c: 1, d: 1}, timeout=5)
        before = _deadlocks(url)
        # The delete waits for d's row; the grant locks c's and waits for d's.
        answers, took = _lined_up(
            url,
            d,
            ("delete", lambda: client.delete_semaphore(d, force=True)),
            ("grant", lambda: client.try_acquire({c: 1, d: 1})),
        )
        assert max(took.values()) < 0.5, took
        assert _deadlocks(url) == before
        # The grant came first (then the delete revoked it too) or after the delete (no such semaphore).
        assert answers["delete"] in (1, 2), answers
        assert client.get_semaphore(c).used == 0
        with pytest.raises(permits.SemaphoreNotFound):
            client.get_semaphore(d)
        assert client.reconcile() == []
