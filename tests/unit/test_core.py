"""The pure parts: validation, decisions, backoff, and flows driven with canned results."""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import pytest

from permits import (
    IdempotencyConflict,
    InvalidArgument,
    KeyInUse,
    LeaseLost,
    ReleaseOutcome,
    SemaphoreNotFound,
    Want,
    _validate,
)
from permits._backoff import Backoff
from permits._core import decide, flows
from permits._core.flows import Result
from permits.dialects.base import Dialect
from permits.dialects.mysql import MariaDB
from permits.dialects.postgresql import PostgreSQL
from permits.dialects.sqlite import SQLite


def test_wants_are_sorted_by_name_for_lock_order() -> None:
    assert _validate.wants({"b": 2, "a": 1}) == (Want("a", 1), Want("b", 2))
    assert _validate.wants("x") == (Want("x", 1),)
    assert _validate.wants(["b", ("a", 3)]) == (Want("a", 3), Want("b", 1))
    # One pair on its own, as written in a list of them; two names are two names.
    assert _validate.wants(("a", 3)) == (Want("a", 3),)
    assert _validate.wants(("b", "a")) == (Want("a", 1), Want("b", 1))
    with pytest.raises(InvalidArgument, match="not bytes"):
        _validate.wants(b"a")


def test_ttl_rounds_up_to_whole_milliseconds() -> None:
    assert _validate.ttl_ms(0.0011) == 2
    assert _validate.ttl_ms(timedelta(minutes=1)) == 60_000
    with pytest.raises(InvalidArgument):
        _validate.ttl_ms(0.0001)


def test_backoff_stays_within_half_and_full_delay() -> None:
    policy = Backoff(base=0.1, cap=1.0)
    rng = random.Random(7)
    for attempt in range(12):
        ceiling = min(1.0, 0.1 * 2**attempt)
        assert ceiling / 2 <= policy.delay(attempt, rng) <= ceiling


def _lease_rows(state: int = 1, reason: str | None = None, expires: int = 2000, now: int = 1000) -> list[tuple]:
    return [(7, state, reason, 500, expires, None if state else 900, now, "a", 2, 41)]


def test_replay_returns_the_same_lease_or_refuses() -> None:
    lease = decide.lease_from_rows(_lease_rows(), "o", "k")
    assert lease is not None and lease.tokens == {"a": 41} and lease.expires_in == 1.0
    assert decide.replay(lease, [Want("a", 2)]) is lease
    with pytest.raises(IdempotencyConflict):
        decide.replay(lease, [Want("a", 1)])
    ended = decide.lease_from_rows(_lease_rows(state=0, reason="released"), "o", "k")
    assert ended is not None
    with pytest.raises(LeaseLost):
        decide.replay(ended, [Want("a", 2)])
    expired = decide.lease_from_rows(_lease_rows(expires=900), "o", "k")
    assert expired is not None
    with pytest.raises(LeaseLost, match="expired"):
        decide.replay(expired, [Want("a", 2)])


def test_a_request_for_a_new_lease_only_is_a_replay_of_its_own_lease_only() -> None:
    held = decide.lease_from_rows(_lease_rows(), "o", "k")
    ended = decide.lease_from_rows(_lease_rows(state=0, reason="released"), "o", "k")
    assert held is not None and ended is not None
    for lease, is_held in ((held, True), (ended, False)):
        with pytest.raises(KeyInUse) as refused:
            decide.replay(lease, [Want("a", 2)], new_only=True)
        assert refused.value.details == {"key": "k", "owner": "o", "held": is_held}
    # Its own (the lease records this request's id): a retry, answered as any retry is.
    assert decide.replay(held, [Want("a", 2)], new_only=True, own=True) is held
    with pytest.raises(LeaseLost):
        decide.replay(ended, [Want("a", 2)], new_only=True, own=True)
    with pytest.raises(IdempotencyConflict) as other:
        decide.replay(held, [Want("a", 1)], new_only=True, own=True)
    assert not isinstance(other.value, KeyInUse)


def test_a_retry_of_a_new_only_request_knows_its_lease_by_the_request_id() -> None:
    """The flow reads the id the lease records (LEASE_FIND's last column) and compares it with its own."""
    request = flows.Request("o", "k", (Want("a", 2),), 5000, new_only=True, request_id="r1")
    for recorded, own in (("r1", True), ("r2", False), (None, False)):
        flow = flows._replay(request)
        assert next(flow).name == "LEASE_FIND"
        rows = [(*row, None, None, recorded) for row in _lease_rows()]  # end_note, ttl_ms, request_id
        if own:
            with pytest.raises(StopIteration) as done:
                flow.send(Result(rows, len(rows)))
            assert done.value.value.key == "k"
        else:
            with pytest.raises(KeyInUse):
                flow.send(Result(rows, len(rows)))


def test_release_outcomes() -> None:
    assert decide.release_outcome(None) == ReleaseOutcome.NOT_FOUND
    released = decide.lease_from_rows(_lease_rows(state=0, reason="released"), "o", "k")
    swept = decide.lease_from_rows(_lease_rows(state=0, reason="swept"), "o", "k")
    assert decide.release_outcome(released) == ReleaseOutcome.ALREADY_RELEASED
    assert decide.release_outcome(swept) == ReleaseOutcome.LOST


def _drive(flow: Any, replies: list[Result]) -> tuple[list[str], Any]:
    """Run a flow on canned results: the names of the statements it sent, and what it returned."""
    sent = [next(flow).name]
    try:
        for reply in replies:
            sent.append(flow.send(reply).name)
    except StopIteration as done:
        return sent, done.value
    raise AssertionError(f"the flow wanted more than {len(replies)} results: {sent}")


def test_a_revoke_tells_whether_it_was_what_ended_the_lease() -> None:
    """The service audits a revoke by this answer, which comes from the locked re-check: of two revokes at
    once, both read the lease as held, and only the one whose locking read still finds it ends it."""
    held, revoked = Result(_lease_rows(), 1), Result(_lease_rows(state=0, reason="revoked"), 1)
    sent, (lease, ended) = _drive(
        flows.revoke_telling("o", "k", "why"),
        [held, Result([(7,)], 1), Result([(3, 2)], 1), Result([], 1), Result([], 1), revoked],
    )
    assert sent == ["LEASE_FIND", "LEASES_LOCK_HELD", "PERMITS_SUM", "LEASES_END", "SEM_GIVE_BACK", "LEASE_FIND"]
    assert ended and lease.end_reason == "revoked"
    # The other revoke: its locking read finds the lease ended already, so it ends nothing, and reads the
    # answer in a transaction of its own (MariaDB's reads here would still show the lease held).
    flow = flows.revoke_telling("o", "k", "why")
    assert next(flow).name == "LEASE_FIND"
    assert flow.send(held).name == "LEASES_LOCK_HELD"
    with pytest.raises(flows.Restart) as restart:
        flow.send(Result([], 0))
    sent, (lease, ended) = _drive(restart.value.flow(), [revoked])
    assert sent == ["LEASE_FIND"] and not ended and lease.end_reason == "revoked"
    # An expired lease, not yet swept: nothing of the holder's to end, and not relabelled.
    expired = Result(_lease_rows(expires=900), 1)
    sent, (lease, ended) = _drive(flows.revoke_telling("o", "k", "why"), [expired])
    assert sent == ["LEASE_FIND"] and not ended and lease.end_reason is None
    # A lease found ended: answered as it is.
    sent, (lease, ended) = _drive(flows.revoke_telling("o", "k", "why"), [revoked])
    assert sent == ["LEASE_FIND"] and not ended and lease.end_reason == "revoked"


def test_acquire_fast_path_statements() -> None:
    """A grant with room is: one conditional UPDATE per semaphore, the lease row, the permit rows (where the
    dialect has no one-statement grant over several semaphores)."""
    d = SQLite()
    flow = flows.try_acquire(d, flows.Request("o", "k", (Want("a", 1), Want("b", 2)), 5000))
    sent = [next(flow)]
    replies = [
        Result([(11, 0)], 1),  # SEM_TAKE a -> token 11, not fair
        Result([(3, 0)], 1),  # SEM_TAKE b -> token 3, not fair
        Result([(99, 1000, 6000)], 1),  # LEASE_INSERT
        Result([], 2),  # PERMIT_INSERT
    ]
    with pytest.raises(StopIteration) as done:
        for reply in replies:
            sent.append(flow.send(reply))
    assert [s.name for s in sent] == ["SEM_TAKE", "SEM_TAKE", "LEASE_INSERT", "PERMIT_INSERT"]
    lease = done.value.value
    assert lease.tokens == {"a": 11, "b": 3} and lease.expires_in == 5.0


@pytest.mark.parametrize(("fair", "queued", "deletes"), [(0, False, False), (1, False, True), (0, True, True)])
def test_a_waiting_grant_gives_up_its_queue_places_only_where_it_may_hold_some(
    fair: int, queued: bool, deletes: bool
) -> None:
    """Places are taken in fair queues only: a grant to a caller that waits deletes the request's places
    when a semaphore it took room from is fair, or when its store knows it queued, and otherwise spends no
    statement on them."""
    request = flows.Request("o", "k", (Want("a", 1), Want("b", 1)), 5000, queue_ms=5000, queued=queued)
    flow = flows.try_acquire(SQLite(), request)
    sent = [next(flow).name, flow.send(Result([(1, 0)], 1)).name, flow.send(Result([(2, fair)], 1)).name]
    assert sent == ["SEM_TAKE", "SEM_TAKE", "WAITERS_DELETE" if deletes else "LEASE_INSERT"]


def test_acquire_without_room_lets_go_at_once_then_checks_without_locks() -> None:
    d = SQLite()
    flow = flows.try_acquire(d, flows.Request("o", "k", (Want("a", 1),), 5000))
    assert next(flow).name == "SEM_TAKE"
    # No room: roll back at once (the refused must not hold the row the next grant needs) ...
    with pytest.raises(flows.Restart) as refused:
        flow.send(Result([], 0))
    assert refused.value.readonly
    # ... then, locking nothing and in one read: whether the key has a lease (a retry must get it, not a
    # refusal), whether expired leases hold the semaphore, and its row.
    check = refused.value.flow()
    assert next(check).name == "REFUSAL_READ"
    with pytest.raises(StopIteration) as done:
        check.send(Result([(0, 0, 5, "a", 1, 1, 0)], 1))
    assert done.value.value is None
    # The key has a lease: it is looked up and replayed.
    check = refused.value.flow()
    next(check)
    assert check.send(Result([(1, 0, 5, "a", 1, 1, 0)], 1)).name == "LEASE_FIND"
    # No such semaphore: the read answers one row of NULLs.
    check = refused.value.flow()
    next(check)
    with pytest.raises(SemaphoreNotFound):
        check.send(Result([(0, 0, None, None, None, None, None)], 1))
    # An expired lease holds the room: reclaim it in a writing transaction of its own, before any semaphore
    # row is locked (lock order: tests/concurrency/test_lock_order.py), then ask again in the next one.
    check = refused.value.flow()
    next(check)
    with pytest.raises(flows.Restart) as reclaim:
        check.send(Result([(0, 1, 5, "a", 1, 1, 0)], 1))
    assert not reclaim.value.readonly
    ending = reclaim.value.flow()
    assert next(ending).name == "EXPIRED_FOR_SEMS"
    assert ending.send(Result([(9,)], 1)).name == "LEASES_LOCK_EXPIRED"
    assert ending.send(Result([(9,)], 1)).name == "PERMITS_SUM"
    assert ending.send(Result([(5, 1)], 1)).name == "LEASES_END"
    assert ending.send(Result([], 1)).name == "SEM_GIVE_BACK"
    with pytest.raises(StopIteration) as committed:
        ending.send(Result([], 1))
    then = committed.value.value
    assert isinstance(then, flows.Then)
    # Asked again as the attempt was (its refusal would still take or keep the request's places in fair
    # queues), but without reclaiming twice: where leases keep expiring, it would never answer.
    again = then.flow()
    assert next(again).name == "SEM_TAKE"
    with pytest.raises(flows.Restart) as refused_again:
        again.send(Result([], 0))
    check = refused_again.value.flow()
    assert next(check).name == "REFUSAL_READ"
    with pytest.raises(StopIteration) as answered:
        check.send(Result([(0, 1, 5, "a", 1, 1, 0)], 1))
    assert answered.value.value is None
    # Only the semaphores that lack room are reclaimed, and the fair ones (their gate counts the waiters
    # ahead, so room for the count is not enough): not a plain one with room.
    three = flows.Request("o", "k", (Want("a", 1), Want("b", 1), Want("c", 1)), 5000)
    check = flows._why_refused(d, three)
    next(check)
    with pytest.raises(flows.Restart) as reclaim:
        check.send(Result([(0, 1, 5, "a", 1, 1, 0), (0, 1, 6, "b", 9, 0, 0), (0, 1, 7, "c", 9, 0, 1)], 3))
    assert dict(next(reclaim.value.flow()).params) == {"sem_ids": [5, 7]}
    # Expired leases, but the one plain semaphore has room (taken back in between): no reclaim.
    check = refused.value.flow()
    next(check)
    with pytest.raises(StopIteration) as done:
        check.send(Result([(0, 1, 5, "a", 3, 1, 0)], 1))
    assert done.value.value is None
    # The read says which semaphores expired leases hold: only those among the ones to reclaim are.
    check = flows._why_refused(d, three)
    next(check)
    with pytest.raises(flows.Restart) as reclaim:
        check.send(Result([(0, 0, 5, "a", 1, 1, 0), (0, 1, 6, "b", 9, 0, 0), (0, 1, 7, "c", 9, 0, 1)], 3))
    assert dict(next(reclaim.value.flow()).params) == {"sem_ids": [7]}
    # Expired leases on a semaphore with room only: none to reclaim where room is lacking, no transaction
    # spent on finding none.
    check = flows._why_refused(d, three)
    next(check)
    with pytest.raises(StopIteration) as done:
        check.send(Result([(0, 0, 5, "a", 1, 1, 0), (0, 1, 6, "b", 9, 0, 0), (0, 0, 7, "c", 9, 0, 0)], 3))
    assert done.value.value is None


def test_every_statement_a_flow_names_exists_in_every_dialect() -> None:
    from permits.dialects.mysql import MariaDB, MySQL

    for dialect in (SQLite(), MariaDB(), MySQL(), PostgreSQL()):
        for name in ("SEM_TAKE", "LEASE_FIND", "LEASE_INSERT", "PERMIT_INSERT", "LEASE_EXTEND", "DRIFT_CHECK"):
            assert dialect.has(name), (dialect.name, name)
        assert dialect.has("RELEASE") or (dialect.has("LEASE_END_ONE") and dialect.has("SEM_GIVE_BACK_LEASE"))


def test_a_release_skips_the_lock_order_step_only_for_a_lease_known_to_be_over_one_semaphore() -> None:
    """RELEASE locks the semaphore rows in name order, as grants do (tests/concurrency/test_lock_order.py);
    RELEASE_ONE has one row to lock. A key alone says nothing of the lease: the ordered form."""
    from permits.dialects.mysql import MariaDB

    def first(dialect: object, one_semaphore: bool) -> str:
        return next(flows.release(dialect, "o", "k", one_semaphore)).name  # type: ignore[arg-type]

    assert first(PostgreSQL(), True) == "RELEASE_ONE"
    assert first(PostgreSQL(), False) == "RELEASE"
    assert first(MariaDB(), True) == "RELEASE"  # no such statement there
    assert first(SQLite(), True) == "LEASE_END_ONE"
    ordered = PostgreSQL().sql("RELEASE")
    assert "ORDER BY s.name" in ordered and "FOR NO KEY UPDATE OF s" in ordered
    assert "FOR NO KEY UPDATE" not in PostgreSQL().sql("RELEASE_ONE")


def test_postgresql_acquires_one_semaphore_in_one_statement() -> None:
    d = PostgreSQL()
    flow = flows.try_acquire(d, flows.Request("o", "k", (Want("a", 1),), 5000))
    first = next(flow)
    assert (first.name, first.alone) == ("ACQUIRE_ONE", True)
    with pytest.raises(StopIteration) as done:
        flow.send(Result([(5, 1000, 6000, 77)], 1))
    assert done.value.value.tokens == {"a": 77}
    # No room: nothing was written, so the slow path starts over in a transaction of its own.
    flow = flows.try_acquire(d, flows.Request("o", "k", (Want("a", 1),), 5000))
    next(flow)
    with pytest.raises(flows.Restart):
        flow.send(Result([], 0))


def test_a_waiting_acquire_on_postgresql_may_ask_outside_an_empty_line_first() -> None:
    """With ``line_free_first``, the first statement is the grant that asks outside the line, bounded by the
    caller's time; no row means "ask in the line" (nothing was written), and a duplicate key replays."""
    d = PostgreSQL().with_statements({"ACQUIRE_ONE_QUEUED": "SELECT 1"})
    request = flows.Request("o", "k", (Want("a", 1),), 5000, line_wait_ms=1500, line_free_first=True)
    flow = flows.try_acquire(d, request)
    first = next(flow)
    assert (first.name, first.alone, first.params["wait_ms"]) == ("ACQUIRE_ONE_LINE_FREE", True, 1500)
    with pytest.raises(StopIteration) as done:
        flow.send(Result([(5, 1000, 6000, 77)], 1))
    assert done.value.value.tokens == {"a": 77}
    flow = flows.try_acquire(d, request)
    next(flow)
    with pytest.raises(StopIteration) as done:
        flow.send(Result([], 0))
    assert done.value.value is flows.ASK_IN_LINE
    flow = flows.try_acquire(d, request)
    next(flow)
    with pytest.raises(flows.Restart):
        flow.throw(flows.DuplicateKey())
    # Without it, or where there is no line, the line's own grant, or the plain one.
    assert next(flows.try_acquire(d, flows.Request("o", "k", (Want("a", 1),), 5000, line_wait_ms=1500))).name == (
        "ACQUIRE_ONE_QUEUED"
    )
    assert next(flows.try_acquire(PostgreSQL(), request)).name == "ACQUIRE_ONE"
    assert "lock_timeout" in d.sql("ACQUIRE_ONE_LINE_FREE") and "pg_try_advisory_xact_lock" in d.sql(
        "ACQUIRE_ONE_LINE_FREE"
    )


def test_postgresql_acquires_several_semaphores_in_one_statement() -> None:
    """All or none, alone; in the line, through the queued grant where the store has it, or else after
    LINES_ENTER in the same transaction."""
    d = PostgreSQL()
    request = flows.Request("o", "k", (Want("a", 1), Want("b", 2)), 5000)
    flow = flows.try_acquire(d, request)
    first = next(flow)
    assert (first.name, first.alone) == ("ACQUIRE_MANY", True)
    assert dict(first.params) == {
        "owner": "o",
        "key": "k",
        "names": ["a", "b"],
        "counts": [1, 2],
        "wants": '[["a", 1], ["b", 2]]',  # the same, for MariaDB's JSON_TABLE
        "ttl_ms": 5000,
        "request_id": None,
        "lock_wait_ms": None,  # the session's lock wait
        "lock_wait_s": None,
    }
    with pytest.raises(StopIteration) as done:
        flow.send(Result([(5, 1000, 6000, "b", 12), (5, 1000, 6000, "a", 77)], 2))
    lease = done.value.value
    assert (lease.tokens, lease.counts, lease.expires_in) == ({"a": 77, "b": 12}, {"a": 1, "b": 2}, 5.0)
    assert list(lease.tokens) == ["a", "b"]  # in name order, whatever order the rows came in
    # The key has a lease already (a retry, or a race with one): the flow answers from it.
    flow = flows.try_acquire(d, request)
    next(flow)
    with pytest.raises(flows.Restart) as duplicate:
        flow.throw(flows.DuplicateKey())
    assert next(duplicate.value.flow()).name == "LEASE_FIND"
    # No room in one of them: nothing was written, and the slow path starts over.
    flow = flows.try_acquire(d, request)
    next(flow)
    with pytest.raises(flows.Restart):
        flow.send(Result([], 0))
    waiting = flows.Request("o", "k", (Want("a", 1), Want("b", 2)), 5000, line_wait_ms=300, line_head_ms=50)
    assert not d.has("ACQUIRE_MANY_QUEUED")  # a function: the store swaps it in where it could make it
    flow = flows.try_acquire(d, waiting)
    entered = next(flow)
    assert (entered.name, entered.alone, dict(entered.params)) == (
        "LINES_ENTER",
        False,
        {"wait_ms": 300, "names": ["a", "b"]},
    )
    granted = flow.send(Result([("300",)], 1))
    assert (granted.name, granted.alone) == ("ACQUIRE_MANY", False)

    class WithQueuedGrants(PostgreSQL):
        def has(self, name: str) -> bool:
            return name == "ACQUIRE_MANY_QUEUED" or super().has(name)

    queued = next(flows.try_acquire(WithQueuedGrants(), waiting))
    assert (queued.name, queued.alone) == ("ACQUIRE_MANY_QUEUED", True)
    assert dict(queued.params)["wait_ms"] == 300 and dict(queued.params)["head_ms"] == 0  # b: 2 permits
    singles = flows.Request("o", "k", (Want("a", 1), Want("b", 1)), 5000, line_wait_ms=300, line_head_ms=50)
    assert dict(next(flows.try_acquire(WithQueuedGrants(), singles)).params)["head_ms"] == 50


def test_on_postgresql_the_refusal_read_and_the_enqueue_each_run_alone() -> None:
    """Where autocommit is free, the read of why a request was refused is a transaction by itself, and so
    is the enqueue that follows it for a fair queue; a key with a lease is looked at again in a transaction
    that can go on to read the lease."""
    d = PostgreSQL()
    flow = flows.try_acquire(d, flows.Request("o", "k", (Want("a", 1), Want("b", 1)), 5000, queue_ms=5000))
    assert next(flow).name == "ACQUIRE_MANY"
    with pytest.raises(flows.Restart) as refused:
        flow.send(Result([], 0))
    check = refused.value.flow()
    read = next(check)
    assert (read.name, read.alone) == ("REFUSAL_READ", True)
    # A fair semaphore and a caller that waits: the enqueue restarts, as one statement, alone.
    with pytest.raises(flows.Restart) as enqueue:
        check.send(Result([(0, 0, 5, "a", 1, 1, 1), (0, 0, 6, "b", 1, 0, 0)], 2))
    placed = next(enqueue.value.flow())
    assert (placed.name, placed.alone) == ("ENQUEUE", True)
    assert dict(placed.params)["sem_ids"] == [5]  # b is not fair: no place in its line
    # The key has a lease: read again, in a transaction, then the lease itself.
    check = refused.value.flow()
    next(check)
    with pytest.raises(flows.Restart) as again:
        check.send(Result([(1, 0, 5, "a", 1, 1, 1), (1, 0, 6, "b", 1, 0, 0)], 2))
    assert again.value.readonly
    retry = again.value.flow()
    read = next(retry)
    assert (read.name, read.alone) == ("REFUSAL_READ", False)
    assert retry.send(Result([(1, 0, 5, "a", 1, 1, 1), (1, 0, 6, "b", 1, 0, 0)], 2)).name == "LEASE_FIND"


MADE_MS = 1_700_000_000_000
#: SEMS_LOCK's row for the semaphore "d": id, name, capacity, used, created_at_ms
D_ROW = (4, "d", 2, 1, MADE_MS)


def _first_transaction(live: list[int]) -> tuple[Any, Any]:
    """A forced delete of "d" that finds ``live`` leases on it: its restart into the first transaction."""
    flow = flows.delete_semaphore("d", force=True)
    assert next(flow).name == "SEMS_LOCK"
    assert flow.send(Result([D_ROW], 1)).name == "LEASES_HOLDING"
    with pytest.raises(flows.Restart) as apart:
        flow.send(Result([(i, 9000, 1000) for i in live], len(live)))
    return apart.value, flow


def _run_first(restart: Any, ended: list[int]) -> Any:
    """Run the first transaction, whose lock finds ``ended`` still held; returns the Then."""
    ending = restart.flow()
    assert next(ending).name == "LEASES_LOCK_HELD"
    if ended:
        assert ending.send(Result([(i,) for i in ended], len(ended))).name == "PERMITS_SUM"
        assert ending.send(Result([(4, len(ended))], 1)).name == "LEASES_END"
        assert ending.send(Result([], len(ended))).name == "SEM_GIVE_BACK"
        result = Result([], 1)
    else:
        result = Result([], 0)
    with pytest.raises(StopIteration) as committed:
        ending.send(result)
    then = committed.value.value
    assert isinstance(then, flows.Then)
    return then


def _run_second(then: Any, semaphore: list[Any], counted: list[int] | None, revoked_now: int) -> int:
    """Run the second transaction: SEMS_LOCK answers ``semaphore``; LEASES_COUNT_REVOKED is asked about
    ``counted`` (None: not asked) and answers ``revoked_now``. Returns the delete's answer."""
    again = then.flow()
    assert next(again).name == "SEMS_LOCK"
    try:
        step = again.send(Result(semaphore, len(semaphore)))
    except StopIteration as done:  # nothing to count: no statement
        assert counted is None
        return int(done.value)
    if step.name == "LEASES_HOLDING":
        step = again.send(Result([], 0))
    if counted is not None:
        assert (step.name, dict(step.params)) == ("LEASES_COUNT_REVOKED", {"ids": counted})
        try:
            step = again.send(Result([(revoked_now,)], 1))
        except StopIteration as done:
            return int(done.value)
    assert step.name == "SEM_WAITERS_DELETE"
    assert again.send(Result([], 0)).name == "SEM_TOMBSTONE"
    with pytest.raises(StopIteration) as deleted:
        again.send(Result([], 1))
    return int(deleted.value.value)


def test_a_delete_ends_the_leases_on_its_semaphore_apart_then_deletes() -> None:
    """Lock order: the leases are ended in a transaction of their own (their rows, then their semaphores in
    name order), then the delete runs again. Should the semaphore be gone by then (another delete), or made
    anew under the name (the same row, made again), this delete answers what it revoked, and leaves it."""
    restart, _ = _first_transaction([8])
    then = _run_first(restart, [8])
    # The delete again: nothing left on it, so it is deleted, and the answer counts the lease it revoked,
    # as the lease's row says.
    assert _run_second(then, [D_ROW], [8], 1) == 1
    # Gone meanwhile, or made anew under the name (another row, or the same one with a new created_at_ms):
    # done, and nothing of the new semaphore is touched.
    for found in ([], [(5, "d", 2, 0, MADE_MS)], [(4, "d", 2, 0, MADE_MS + 5)]):
        assert _run_second(then, found, [8], 1) == 1


def test_a_delete_whose_commit_reply_was_lost_still_counts_what_it_revoked() -> None:
    """The first transaction revoked the lease and committed, but its reply never came: the store runs it
    again, which finds the lease ended already and revokes nothing. The count still has the lease. The same
    for the second transaction: its retry finds the semaphore gone, and answers what both revoked."""
    restart, _ = _first_transaction([8])
    _run_first(restart, [8])  # committed; the reply is lost
    then = _run_first(restart, [])  # the store's retry of the same transaction
    assert _run_second(then, [D_ROW], [8], 1) == 1
    # A lease granted between the two transactions is revoked in place by the second.
    restart, _ = _first_transaction([8])
    then = _run_first(restart, [8])
    again = then.flow()
    next(again)
    again.send(Result([D_ROW], 1))
    assert again.send(Result([(9, 9000, 1000)], 1)).name == "LEASES_LOCK_HELD"
    assert again.send(Result([(9,)], 1)).name == "PERMITS_SUM"
    assert again.send(Result([(4, 1)], 1)).name == "LEASES_END"
    assert again.send(Result([], 1)).name == "SEM_GIVE_BACK"
    counted = again.send(Result([], 1))
    assert (counted.name, dict(counted.params)) == ("LEASES_COUNT_REVOKED", {"ids": [8, 9]})
    # ... and its COMMIT reply is lost: the retry finds the semaphore deleted, and still counts both.
    assert _run_second(then, [], [8, 9], 2) == 2


def test_a_delete_counts_only_the_leases_it_revoked_itself() -> None:
    """Two forced deletes of one semaphore at once, or an administrator's revoke of one of its leases in
    between: a lease someone else ended first is theirs, not this delete's."""
    restart, _ = _first_transaction([8, 9])
    then = _run_first(restart, [9])  # 8 was revoked by someone else before this transaction locked it
    assert _run_second(then, [D_ROW], [9], 1) == 1
    restart, _ = _first_transaction([8, 9])
    then = _run_first(restart, [])  # the other delete revoked both first, and deleted the semaphore
    assert _run_second(then, [], None, 0) == 0


@pytest.mark.parametrize("dialect", [PostgreSQL(), MariaDB()], ids=["postgresql", "mysql"])
@pytest.mark.parametrize("wants", [(Want("a", 2),), (Want("a", 1), Want("b", 1))], ids=["one", "several"])
def test_a_grant_waits_for_a_row_lock_within_the_callers_time(dialect: Dialect, wants: tuple[Want, ...]) -> None:
    """The grant's statement is given the caller's time left as its lock wait: in milliseconds for
    PostgreSQL's lock_timeout, in whole seconds, rounded up, for MariaDB's innodb_lock_wait_timeout."""
    request = flows.Request("o", "k", wants, 5000, lock_wait_ms=1200)
    first = next(flows.try_acquire(dialect, request))
    assert first.name in ("ACQUIRE_ONE", "ACQUIRE_MANY")
    assert (first.params["lock_wait_ms"], first.params["lock_wait_s"]) == (1200, 2)
    assert ":lock_wait_ms" in dialect.sql(first.name) or ":lock_wait_s" in dialect.sql(first.name)


def test_lock_waits_in_whole_seconds_are_rounded_up_and_never_zero() -> None:
    assert [flows.lock_wait_seconds(ms) for ms in (None, 1, 999, 1000, 1001, 4500)] == [None, 1, 1, 1, 2, 5]
