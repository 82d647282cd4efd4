"""Every operation, written once, as a generator that yields named statements and receives their results.

A flow runs inside one transaction that its driver opens and commits (``stores``); the driver sends each
statement's ``Result`` back into the generator and takes the generator's return value as the answer.
The same flow serves the sync and the asyncio store, and every SQL dialect: flows ask for statements by
name (``dialects``) and never assemble SQL.

Two signals go the other way:
- the driver throws ``DuplicateKey`` into the flow when a statement hits a unique constraint, and
- a flow raises ``Restart(next_flow)`` when the transaction must be rolled back and another flow run in a
  fresh one (not counted as a retry), and ``Retry`` when the whole operation must run again (counted).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from permits._core import decide
from permits._exceptions import (
    LeaseNotFound,
    SemaphoreExists,
    SemaphoreInUse,
    SemaphoreNotFound,
    StorageError,
)
from permits._models import (
    CapacityChange,
    Drift,
    EndReason,
    Holder,
    Lease,
    ReleaseOutcome,
    Semaphore,
    Waiter,
    Want,
    ms_to_datetime,
)

if TYPE_CHECKING:
    from permits.dialects.base import Dialect

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Stmt:
    """A request to run the dialect's statement ``name``; a list of params runs it once per item."""

    name: str
    params: Mapping[str, Any] | Sequence[Mapping[str, Any]] = field(default_factory=dict)
    #: This statement is a whole transaction by itself: where the dialect can switch to autocommit for
    #: free, the driver sends it alone, with no BEGIN and no COMMIT. A flow that yields ``alone`` first
    #: must then return or raise ``Restart``; it may not send a second statement, unless this one left a
    #: transaction open on its connection (MariaDB's line: ``_acquire_one_in_line``). Then the next one,
    #: ``alone`` too, goes on with it on the same connection; a flow that stops with the transaction still
    #: open costs the store that connection, which it drops rather than reuse.
    alone: bool = False


@dataclass(frozen=True, slots=True)
class Result:
    rows: list[tuple[Any, ...]]
    rowcount: int
    lastrowid: int | None = None


Flow: TypeAlias = Generator[Stmt, Result, T]


class DuplicateKey(Exception):
    """Thrown into a flow: its last statement hit a unique constraint. The transaction is unusable."""


class Retry(Exception):
    """Raised by a flow: the transaction read a state that a concurrent commit had already moved on from
    (a node of a multi-primary cluster that had not yet applied a grant, say). Roll back and run the
    operation again from its start, with backoff, as for a conflict."""


class Restart(Exception):
    """Raised by a flow: roll back, then run ``flow()`` in a new transaction (a read-only one if
    ``readonly``: on SQLite it then does not take the write lock)."""

    def __init__(self, flow: Callable[[], Flow[Any]], readonly: bool = False) -> None:
        super().__init__("restart")
        self.flow = flow
        self.readonly = readonly


class Then:
    """Returned by a flow: commit what it did, then run ``flow()`` in a new transaction; its answer is the
    operation's. For work that must be committed before the rest locks anything (see ``_reclaim_then``)."""

    __slots__ = ("flow",)

    def __init__(self, flow: Callable[[], Flow[Any]]) -> None:
        self.flow = flow


# ---------------------------------------------------------------------------------------------- acquire


@dataclass(frozen=True, slots=True)
class Request:
    """An acquire request, as the acquire flows pass it between themselves."""

    owner: str
    key: str
    wants: Sequence[Want]
    ttl_ms: int
    #: > 0: the caller waits, and on a fair semaphore a refused request takes a place in the queue, kept
    #: this long unless the caller asks again
    queue_ms: int = 0
    #: the request holds places in fair queues (its store put it there), and learns its place when refused
    queued: bool = False
    #: the caller's wake channel (PostgreSQL), recorded in its places: a release calls it when its turn comes
    wake: str | None = None
    #: not None: the attempt waits for its turn in the server's lock queue, the semaphore's line, for up to
    #: this many milliseconds in all, and at the head of the line up to ``line_head_ms`` for room
    #: (PostgreSQL's queued grants; for several semaphores, in the line of the first of them). Elsewhere the
    #: attempt is the usual one.
    line_wait_ms: int | None = None
    line_head_ms: int = 0
    #: not None: this attempt waits for a row lock no longer than this (what is left of the caller's time,
    #: when that is less than the session's lock wait); None: the session's lock wait (a try, which does not
    #: wait for room, still waits that long for a lock). MariaDB's statements take it in whole seconds.
    lock_wait_ms: int | None = None
    #: with ``line_wait_ms``: first ask outside the line, granted only while nobody is in it
    #: (``ACQUIRE_ONE_LINE_FREE``); when that does not grant, the answer is ``AskInLine``
    line_free_first: bool = False
    #: this attempt has ended the expired leases in its way already, and does not again (``_reclaim_then``)
    reclaimed: bool = False
    #: a lease under the key is refused (``KeyInUse``), not answered as this request's (``decide.replay``),
    #: unless it records ``request_id``
    new_only: bool = False
    #: the id the caller made up for this request, the same in each of its tries: its lease records it, so
    #: that a retry of a ``new_only`` request whose reply was lost knows the lease as its own
    request_id: str | None = None


def try_acquire(d: Dialect, req: Request, recheck: bool = True) -> Flow[Lease | Queued | AskInLine | None]:
    """Grant every want or none; ``None`` means no room (after reclaiming expired leases).

    The fast path is one conditional UPDATE per semaphore, in name order: it counts the permits and bumps
    the fencing token on the semaphore row, so capacity is checked by the database at the moment the row
    is written, and every grant writes the row (multi-primary engines such as Galera certify only rows a
    transaction writes). Where the dialect has them, that and the lease are one statement: ``ACQUIRE_ONE``
    for one semaphore, ``ACQUIRE_MANY`` for several. Only when a semaphore has no room does the flow look
    further.

    A request with ``queue_ms`` > 0 waits: on a fair semaphore a refused request then takes a place in the
    queue, and a grant gives its places up. The place records ``wake``, the caller's wake channel
    (PostgreSQL), which a release notifies when the request's turn comes.

    ``recheck=False`` is for a waiter asking again soon after a full refusal: no room is then the answer at
    once, without the transaction that finds out why (the key's earlier grant, expired leases to reclaim,
    the queue place to keep). A waiting caller rechecks at least once a second and after any failure, so
    a refusal costs one statement while the reasons it skips cannot change the outcome for long. A request
    that is ``queued`` (it holds fair-queue places) learns its place instead, to pace its next attempt.
    """
    if len(req.wants) == 1 and d.has("ACQUIRE_ONE"):
        return (yield from _acquire_one(d, req, recheck))
    if d.has("ACQUIRE_MANY"):
        return (yield from _acquire_many(d, req, recheck))
    tokens: dict[str, int] = {}
    places = req.queued  # whether the request may hold places in fair queues
    for want in req.wants:
        taken = yield Stmt(
            "SEM_TAKE",
            {
                "name": want.name,
                "count": want.count,
                "owner": req.owner,
                "key": req.key,
                "lock_wait_s": lock_wait_seconds(req.lock_wait_ms),
            },
        )
        if taken.rowcount == 0:
            raise _refused(d, req, recheck)
        tokens[want.name] = d.taken_token(taken)
        # Places are taken in fair queues only: a waiter granted on plain semaphores has none to give up.
        places = places or (req.queue_ms > 0 and d.taken_fair(taken) is not False)
    if places:  # a grant gives up the request's places, even on an attempt that would not queue
        yield Stmt("WAITERS_DELETE", {"owner": req.owner, "key": req.key})
    return (yield from _insert_lease(d, req, tokens))


def _refused(d: Dialect, req: Request, recheck: bool = True) -> Restart:
    """A semaphore had no room (or does not exist). Roll back at once, which lets go of the semaphore
    rows, and find out why without locking anything: on a hot semaphore the refused are the many, and
    they must not hold the row that the next grant needs."""
    if not recheck:
        if req.queued:
            return Restart(lambda: queue_place(req.owner, req.key, alone=d.free_autocommit), readonly=True)
        return Restart(_no_room)
    return Restart(lambda: _why_refused(d, req), readonly=True)


def _no_room() -> Flow[None]:
    """The answer of a refusal that is not rechecked: no statement, no room."""
    yield from ()  # a flow that sends nothing
    return None


def _why_refused(d: Dialect, req: Request, may_run_alone: bool = True) -> Flow[Lease | Queued | None]:
    # Three questions in one read: has this key a lease already (a retry of a request that was granted
    # must get it back, not a refusal for lack of room), do expired leases hold these semaphores, and what
    # are their rows. Where autocommit is free the read is a transaction by itself, and whatever must
    # follow it (rarely needed, but for a place in a fair queue) restarts in a new one.
    alone = may_run_alone and d.free_autocommit
    names = [w.name for w in req.wants]
    found = yield Stmt("REFUSAL_READ", {"owner": req.owner, "key": req.key, "names": names}, alone=alone)
    if any(int(row[0]) for row in found.rows):
        if alone:  # look again, in a transaction that can go on to read the lease
            raise Restart(lambda: _why_refused(d, req, may_run_alone=False), readonly=True)
        under_key = yield from find_lease(req.owner, req.key)
        if under_key is not None:
            return _answer_retry(req, *under_key)
    expired = {int(row[2]) for row in found.rows if int(row[1])}  # the semaphores expired leases hold
    rows = [row[2:] for row in found.rows if row[2] is not None]
    sems = {str(name): (int(sid), int(cap), int(used)) for sid, name, cap, used, _ in rows}
    fair = {str(name): int(sid) for sid, name, _, _, is_fair in rows if int(is_fair)}
    for want in req.wants:
        if want.name not in sems:
            raise SemaphoreNotFound(f"no semaphore named {want.name!r}", name=want.name)
    decide.check_counts(req.wants, {n: cap for n, (_, cap, _) in sems.items()})
    # Expired leases never block: where they hold semaphores that lack room, or fair ones (whose gate counts
    # the waiters ahead, so that room for the count is not enough), reclaim them (under lock) and try again.
    # Expired leases on a semaphore with room would make none that is needed: they are left to the sweep.
    # Once per attempt: where leases keep expiring, it would never answer.
    reclaim = sorted({*_lacking_room(req.wants, sems), *fair.values()} & expired)
    if reclaim and not req.reclaimed:
        raise Restart(lambda: _reclaim_then(d, req, reclaim))
    if req.queue_ms and fair:
        if d.cheaper_readonly or alone:
            raise Restart(lambda: _enqueue(d, req, fair, first=True))
        # Elsewhere this transaction can write as it is: a waiter joins the queue without a second one.
        return (yield from _enqueue(d, req, fair))
    return None


class AskInLine:
    """What an attempt that asked outside the line (``Request.line_free_first``) answers when it was not
    granted: somebody was in the line, or there was no room. Nothing was written; the store asks again in
    the line, as a first attempt, and may remember that the line was busy."""

    __slots__ = ()


ASK_IN_LINE = AskInLine()


class Queued:
    """What an attempt answers when it was refused and holds a place in a fair queue: no grant, like
    ``None``, but the store then knows a timeout has a place to give up, and the waiter can pace itself.

    ``short`` is how many permits the request is short of fitting, in the fullest of its fair queues: the
    permits in use, plus those wanted by the live waiters ahead of it and by itself, minus the capacity.
    It falls as permits come back; at 0 or less the request would fit now. ``None``: not measured."""

    __slots__ = ("short",)

    def __init__(self, short: int | None = None) -> None:
        self.short = short


def _enqueue(
    d: Dialect, req: Request, fair: Mapping[str, int], first: bool = False, heal: bool = False
) -> Flow[Queued]:
    """Keep this request's places in the fair queues, or take them, so that every semaphore orders any two
    requests alike: one ticket for all of them from the dialect's sequence (``TICKET_NEXT``), or else a
    ticket per fair semaphore from its row's counter, taken in name order under each row's lock.
    ``first``: this is the transaction's first statement (it may then run alone, see ``ENQUEUE``).

    A place's key (semaphore, ticket) met on the way is the same request enqueued at the same time by
    another attempt of its own, or a ticket counter behind its queue (a restore of the semaphore rows
    older than the queue's, or a hand edit: ``reconcile`` reports it). The attempt then starts again with
    ``heal``: each ticket counter is first raised to its queue's highest ticket, as ``reconcile --repair``
    would (a sequence shared by every queue: to the highest of the request's queues). Without it, where
    the counter is the row's, every enqueue rolled back the ticket it took and met the same key again,
    until the operation gave up ("kept restarting")."""
    place = {"owner": req.owner, "key": req.key, "place_ms": req.queue_ms, "wake": req.wake}
    if d.has("ENQUEUE"):
        queues = [(fair[w.name], w.count) for w in req.wants if w.name in fair]
        if heal:  # one sequence for every queue: raised once, past the highest of the request's queues
            highest = 0
            for sem_id, _ in queues:
                highest = max(highest, int((yield Stmt("TICKET_HIGHEST_ONE", {"sem_id": sem_id})).rows[0][0] or 0))
            if highest:
                yield Stmt("SEM_RAISE_TICKET", {"id": queues[0][0], "ticket": highest})
            first = False
        params = {**place, "sem_ids": [sid for sid, _ in queues], "counts": [count for _, count in queues]}
        try:
            placed = yield Stmt("ENQUEUE", params, alone=first and d.free_autocommit)
        except DuplicateKey:
            raise Restart(lambda: _enqueue(d, req, fair, first=True, heal=True)) from None
        return Queued(max(int(row[0]) for row in placed.rows)) if placed.rows else Queued()
    kept = yield Stmt("WAITERS_REFRESH", place)
    if kept.rowcount == 0:
        shared = int((yield Stmt("TICKET_NEXT")).rows[0][0]) if d.has("TICKET_NEXT") else None
        for want in req.wants:
            if want.name not in fair:
                continue
            ticket = shared
            if ticket is None and heal:  # takes the row's lock before SEM_TICKET would, in name order too
                queue_top = yield Stmt("TICKET_HIGHEST_ONE", {"sem_id": fair[want.name]})
                yield Stmt("SEM_RAISE_TICKET", {"id": fair[want.name], "ticket": int(queue_top.rows[0][0] or 0)})
            if ticket is None:
                ticket = d.taken_token((yield Stmt("SEM_TICKET", {"id": fair[want.name]})))
            try:
                yield Stmt("WAITER_INSERT", {**place, "sem_id": fair[want.name], "ticket": ticket, "count": want.count})
            except DuplicateKey:
                raise Restart(lambda: _enqueue(d, req, fair, first=True, heal=True)) from None
    return (yield from queue_place(req.owner, req.key)) or Queued()


def queue_place(owner: str, key: str, alone: bool = False) -> Flow[Queued | None]:
    """How far a queued request is from fitting (see ``Queued``); ``None`` when it holds no live place.
    ``alone``: the read is a transaction by itself (where autocommit is free: no BEGIN, no COMMIT)."""
    found = yield Stmt("WAITER_SHORT", {"owner": owner, "key": key}, alone=alone)
    if not found.rows:
        return None
    return Queued(max(int(row[0]) for row in found.rows))


@dataclass(frozen=True, slots=True)
class OpenRoom:
    """What a request holding no place in a semaphore's fair queue could take now: the free permits less
    those the live places want (``free``; on a plain semaphore, just the free permits), and how many live
    places there are (``places``; 0 on a plain semaphore). Exactly when ``free`` is at least its count, the
    fair gate lets such a request through."""

    free: int
    places: int
    fair: bool


def open_room(name: str) -> Flow[OpenRoom]:
    """``OpenRoom`` of one semaphore, in one read that takes no lock (the head of a line beside a SQLite
    database reads it while it waits)."""
    found = yield Stmt("SEM_OPEN_ROOM", {"name": name})
    if not found.rows:
        raise SemaphoreNotFound(f"no semaphore named {name!r}", name=name)
    free, places, fair = found.rows[0]
    return OpenRoom(int(free), int(places), bool(int(fair)))


def dequeue(owner: str, key: str) -> Flow[int]:
    """Give up a request's places in the fair queues (its wait timed out)."""
    done = yield Stmt("WAITERS_DELETE", {"owner": owner, "key": key})
    return done.rowcount


def waiters(name: str) -> Flow[list[Waiter]]:
    sem = yield Stmt("SEM_GET", {"name": name})
    if not sem.rows:
        raise SemaphoreNotFound(f"no semaphore named {name!r}", name=name)
    rows = yield Stmt("WAITERS_LIST", {"name": name})
    return [decide.waiter_from_row(r) for r in rows.rows]


def purge_waiters(age_ms: int) -> Flow[int]:
    done = yield Stmt("WAITERS_PURGE", {"age_ms": age_ms})
    return done.rowcount


def _acquire_one(d: Dialect, req: Request, recheck: bool = True) -> Flow[Lease | Queued | AskInLine | None]:
    """One semaphore, one statement: take the room, insert the lease and its permit row, and give up the
    request's place in a fair queue if it had one, all or nothing.

    When there is no room, the statement changes nothing and the slow path runs in a transaction of its
    own (the key check, the reclaim of expired leases, a place in a fair queue for a caller that waits).
    """
    (want,) = req.wants
    params = {
        "owner": req.owner,
        "key": req.key,
        "name": want.name,
        "count": want.count,
        "ttl_ms": req.ttl_ms,
        "request_id": req.request_id,
        "lock_wait_ms": req.lock_wait_ms,
        "lock_wait_s": lock_wait_seconds(req.lock_wait_ms),
    }
    statement = "ACQUIRE_ONE"
    lined = req.line_wait_ms is not None and (d.has("ACQUIRE_ONE_QUEUED") or d.has("LINE_WAIT"))
    outside_line = lined and req.line_free_first and d.has("ACQUIRE_ONE_LINE_FREE")
    if outside_line:
        statement = "ACQUIRE_ONE_LINE_FREE"
        params.update(wait_ms=req.line_wait_ms)
    elif lined and d.has("LINE_WAIT"):
        return (yield from _acquire_one_in_line(d, req, params, recheck))
    elif lined:
        statement = "ACQUIRE_ONE_QUEUED"
        # The queued grant bounds its waits, for the line and for the row, by wait_ms itself.
        params.update(wait_ms=req.line_wait_ms, head_ms=req.line_head_ms, lock_wait_ms=None)
    try:
        done = yield Stmt(statement, params, alone=True)
    except DuplicateKey:
        raise Restart(lambda: _replay(req)) from None
    if not done.rows and outside_line:
        if d.has("LINE_WAIT") and req.line_wait_ms is not None and req.line_wait_ms < 1000:
            # MariaDB's line takes no wait under a second (_acquire_one_in_line): in it, this request would
            # only ask outside it again, as it just did.
            raise _refused(d, req, recheck)
        return ASK_IN_LINE
    if not done.rows:
        raise _refused(d, req, recheck)
    _, acquired_ms, expires_ms, token = done.rows[0]
    return _granted(req, {want.name: int(token)}, acquired_ms, expires_ms)


def _acquire_one_in_line(
    d: Dialect, req: Request, params: dict[str, Any], recheck: bool
) -> Flow[Lease | Queued | AskInLine | None]:
    """``_acquire_one`` in the semaphore's line on MariaDB, in one transaction on one connection: wait for the
    turn (``LINE_WAIT``, whole seconds within ``line_wait_ms``), ask (``LINE_GRANT``, which commits if it
    granted, and so lets the line go), and, refused, wait at the head up to ``line_head_ms`` for room, again
    each time the fair queue ahead moves (``LINE_HEAD``, which commits either way). A wait in the line that
    timed out is a refusal. With less than a second left there is no wait in the line: the request asks
    outside it, granted only while nobody is in it, as it did at first."""
    assert req.line_wait_ms is not None
    wait_s = req.line_wait_ms // 1000
    try:
        if wait_s < 1:
            done = yield Stmt("ACQUIRE_ONE_LINE_FREE", params, alone=True)
        else:
            wait = {"name": params["name"], "wait_s": wait_s, "wait_ms": req.line_wait_ms, "count": params["count"]}
            in_line, sem_id, _, fair = (yield Stmt("LINE_WAIT", wait, alone=True)).rows[0]
            if not int(in_line):  # timed out, or no such semaphore, or one too small: the refusal says which
                raise _refused(d, req, recheck)
            at_head = {**params, "sem_id": int(sem_id)}
            done = yield Stmt("LINE_GRANT", at_head, alone=True)
            if not done.rows:
                # On a fair semaphore the head's wait starts again as the fair queue ahead of it moves, within
                # the caller's time (LINE_HEAD, dialects/mysql.py).
                head = {"tries": head_tries(req.line_head_ms), "most_tries": head_tries(req.line_wait_ms)}
                done = yield Stmt("LINE_HEAD_FAIR" if int(fair) else "LINE_HEAD", {**at_head, **head}, alone=True)
    except DuplicateKey:
        raise Restart(lambda: _replay(req)) from None
    if not done.rows:
        raise _refused(d, req, recheck)
    _, acquired_ms, expires_ms, token = done.rows[0]
    return _granted(req, {params["name"]: int(token)}, acquired_ms, expires_ms)


def lock_wait_seconds(lock_wait_ms: int | None) -> int | None:
    """``Request.lock_wait_ms`` in the whole seconds MariaDB's ``innodb_lock_wait_timeout`` counts: rounded up,
    so that the wait is never cut short of the caller's time, and at least one (zero would not wait at all)."""
    return None if lock_wait_ms is None else max(1, -(-lock_wait_ms // 1000))


def head_tries(head_ms: int) -> int:
    """How many times ``LINE_HEAD`` asks at the head of the line to wait about ``head_ms`` more there: 1 ms
    apart ten times, then 2 ms apart (after ``LINE_GRANT`` asked once). On a fair semaphore, a try that finds
    the semaphore row busy with another writer (``LINE_HEAD_FAIR``, which does not wait for the row's lock
    while places are ahead) asks again 0.2 ms later, and counts as a tenth of a try."""
    return max(1, min(head_ms, 10) + max(0, head_ms - 10) // 2)


def _acquire_many(d: Dialect, req: Request, recheck: bool = True) -> Flow[Lease | Queued | None]:
    """Several semaphores, one statement (``ACQUIRE_MANY``): all or none, as ``_acquire_one`` does for one.

    A waiter whose attempt goes in the line (``line_wait_ms``) asks through the queued grant, which waits for
    its turn in the line of the first semaphore and grants in the same round trip. Where the store could
    not make that function, it waits with ``LINES_ENTER`` and then grants, in one transaction whose commit
    lets the line go."""
    params = {
        "owner": req.owner,
        "key": req.key,
        "names": [w.name for w in req.wants],
        "counts": [w.count for w in req.wants],
        # The same wants as one JSON text, for a server without array parameters (MariaDB's JSON_TABLE).
        "wants": json.dumps([[w.name, w.count] for w in req.wants], ensure_ascii=False),
        "ttl_ms": req.ttl_ms,
        "request_id": req.request_id,
        "lock_wait_ms": req.lock_wait_ms,
        "lock_wait_s": lock_wait_seconds(req.lock_wait_ms),
    }
    statement, in_line = "ACQUIRE_MANY", False
    if req.line_wait_ms is not None and d.has("ACQUIRE_MANY_QUEUED"):
        statement = "ACQUIRE_MANY_QUEUED"
        # At the head it waits for room, but not for several permits of one semaphore: it would hold the line
        # while single permits came back behind it (as the store's queues_in_line says for one semaphore).
        head_ms = req.line_head_ms if all(w.count == 1 for w in req.wants) else 0
        params.update(wait_ms=req.line_wait_ms, head_ms=head_ms, lock_wait_ms=None)  # as ACQUIRE_ONE_QUEUED
    elif req.line_wait_ms is not None and d.has("LINES_ENTER"):
        in_line = True  # where the queued grant could not be made: the line in a transaction of its own
        # LINES_ENTER leaves its transaction's lock_timeout at what its wait left: the grant keeps that.
        params["lock_wait_ms"] = None
        yield Stmt("LINES_ENTER", {"wait_ms": req.line_wait_ms, "names": params["names"]})
    try:
        done = yield Stmt(statement, params, alone=not in_line)
    except DuplicateKey:
        raise Restart(lambda: _replay(req)) from None
    if not done.rows:
        raise _refused(d, req, recheck)
    _, acquired_ms, expires_ms = done.rows[0][:3]
    return _granted(req, {str(row[3]): int(row[4]) for row in done.rows}, acquired_ms, expires_ms)


@dataclass(frozen=True, slots=True)
class HandedOver:
    """What one turn of a semaphore's line did (``hand_over``)."""

    #: per release, in the order given: whether this turn released it. One it did not was not held (or its
    #: TTL had passed, or it holds permits of another semaphore too): released alone, it says what it is.
    released: list[bool]
    #: per request, in the order given: its lease, or ``None`` when this turn did not grant it
    leases: list[Lease | None]
    #: the requests not granted must each ask alone, which tells their cases apart: the semaphore is fair
    #: (its queue orders its requests), or gone, or a key among them has a lease already (a retry of a
    #: granted request, answered from its lease when it asks alone). Otherwise they found no room left.
    ask_alone: bool = False
    #: the semaphore is fair: its requests are not for the line's turns
    fair: bool = False
    #: the permits left free once the turn was done (``None``: not known)
    room: int | None = None


def hand_over(name: str, gone: Sequence[tuple[str, str]], reqs: Sequence[Request]) -> Flow[HandedOver]:
    """Group commit, for the service's lines: in one statement and one commit (``HAND_OVER``, where the
    dialect has it), release the leases ``gone`` (owner, key), each over the semaphore ``name`` alone, and
    grant ``reqs``, requests for one permit each of ``name``, in the order given, as many as the room then
    allows. The semaphore's row is written once, conditionally, for all of it. Expired leases are not
    reclaimed here: a request that found no room asks alone, with its full recheck, as a waiter does."""
    assert all(len(r.wants) == 1 and r.wants[0].name == name and r.wants[0].count == 1 for r in reqs), reqs
    params = {
        "name": name,
        "gone_owners": [owner for owner, _ in gone],
        "gone_keys": [key for _, key in gone],
        "owners": [r.owner for r in reqs],
        "keys": [r.key for r in reqs],
        "ttls": [r.ttl_ms for r in reqs],
        # The same as JSON texts, for a server without array parameters (MariaDB's JSON_TABLE).
        "gone": json.dumps([[owner, key] for owner, key in gone], ensure_ascii=False),
        "asked": json.dumps([[r.owner, r.key, r.ttl_ms] for r in reqs], ensure_ascii=False),
    }
    try:
        done = yield Stmt("HAND_OVER", params, alone=True)
    except DuplicateKey:
        raise Restart(lambda: _handed_nothing(len(gone), len(reqs))) from None
    granted: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
    released: set[tuple[str, str]] = set()
    fair: Any = None
    room: Any = None
    for kind, owner, key, at, until, token in done.rows:
        if kind == 1:
            granted[(str(owner), str(key))] = (token, at, until)
        elif kind == 2:
            released.add((str(owner), str(key)))
        elif kind == 3:
            room, fair = at, token
    leases: list[Lease | None] = []
    for req in reqs:
        found = granted.get((req.owner, req.key))
        leases.append(None if found is None else _granted(req, {name: int(found[0])}, found[1], found[2]))
    return HandedOver(
        [lease in released for lease in gone],
        leases,
        ask_alone=fair is None or bool(fair),
        fair=bool(fair),
        room=None if room is None else int(room),
    )


def _handed_nothing(releases: int, requests: int) -> Flow[HandedOver]:
    """A turn in which a key had a lease already: it did nothing, and everything in it asks alone."""
    yield from ()  # a flow that sends nothing
    return HandedOver([False] * releases, [None] * requests, ask_alone=True)


def _reclaim_then(d: Dialect, req: Request, sem_ids: Sequence[int]) -> Flow[Then]:
    """End the expired leases that hold any of ``sem_ids`` (the semaphores that lack room, and the fair ones)
    and commit, then ask again, as the attempt would have (a refusal still takes or keeps the request's
    places in fair queues), but without reclaiming again and outside the line.

    In a transaction of its own, before the request locks any semaphore row: ending a lease locks its row
    and then gives back to each of its semaphores, in name order, as a release does. Done while holding
    the request's semaphore rows, that locked a lease row after a semaphore row, and gave back to
    semaphores the request had not locked, lower in name order than those it had: both against the order
    of everyone else, and a release or a sweep running beside it deadlocked (1 s on PostgreSQL)."""
    expired = yield Stmt("EXPIRED_FOR_SEMS", {"sem_ids": list(sem_ids)})
    if expired.rows:
        yield from _end_expired([int(r[0]) for r in expired.rows])
    again = replace(req, reclaimed=True, line_wait_ms=None)
    return Then(lambda: try_acquire(d, again))


def _lacking_room(wants: Sequence[Want], sems: Mapping[str, tuple[int, int, int]]) -> list[int]:
    """The ids of the semaphores (``sems``: name -> id, capacity, used) without room for their wants."""
    return sorted(sems[w.name][0] for w in wants if not decide.has_room(w, sems[w.name][1], sems[w.name][2]))


def _insert_lease(d: Dialect, req: Request, tokens: dict[str, int]) -> Flow[Lease]:
    try:
        params = {"owner": req.owner, "key": req.key, "ttl_ms": req.ttl_ms, "request_id": req.request_id}
        inserted = yield Stmt("LEASE_INSERT", params)
    except DuplicateKey:
        # The key is taken: this is a retry of a request that was granted (or a race with one). Roll back
        # the room just taken and answer from the lease that exists.
        raise Restart(lambda: _replay(req)) from None
    if d.insert_returning:
        lease_id, acquired_ms, expires_ms = inserted.rows[0]
    else:
        lease_id = inserted.lastrowid
        times = yield Stmt("LEASE_TIMES", {"id": lease_id})
        acquired_ms, expires_ms = times.rows[0]
    yield Stmt(
        "PERMIT_INSERT",
        [{"lease_id": lease_id, "name": w.name, "count": w.count, "token": tokens[w.name]} for w in req.wants],
    )
    return _granted(req, tokens, acquired_ms, expires_ms)


def _granted(req: Request, tokens: Mapping[str, int], acquired_ms: Any, expires_ms: Any) -> Lease:
    """The lease a grant of ``req`` answers, from its tokens (by name) and its times as the database stamped
    them (epoch milliseconds). Wants and tokens are listed in name order, whatever order the rows came in."""
    acquired, expires = int(acquired_ms), int(expires_ms)
    return Lease(
        key=req.key,
        owner=req.owner,
        counts={w.name: w.count for w in req.wants},
        tokens={w.name: tokens[w.name] for w in req.wants},
        acquired_at=ms_to_datetime(acquired),
        expires_at=ms_to_datetime(expires),
        expires_in=(expires - acquired) / 1000,
        ttl=req.ttl_ms / 1000,
    )


def _replay(req: Request) -> Flow[Lease]:
    found = yield from find_lease(req.owner, req.key)
    if found is None:
        # No lease under the key: the duplicate was not the key's. Either a concurrent acquire with the key
        # rolled back, or (on Galera) a node behind the cluster computed a fencing token already taken.
        raise Retry()
    return _answer_retry(req, *found)


def _answer_retry(req: Request, existing: Lease, request_id: str | None) -> Lease:
    """The answer to ``req`` when its key names ``existing`` already, which the request ``request_id`` got."""
    own = req.request_id is not None and request_id == req.request_id
    return decide.replay(existing, req.wants, req.new_only, own=own)


def find_lease(owner: str, key: str) -> Flow[tuple[Lease, str | None] | None]:
    """The lease under the key, if any, and the id of the request that got it (``Request.request_id``)."""
    found = yield Stmt("LEASE_FIND", {"owner": owner, "key": key})
    lease = decide.lease_from_rows(found.rows, owner, key)
    if lease is None:
        return None
    request_id = found.rows[0][12] if len(found.rows[0]) > 12 else None
    return lease, None if request_id is None else str(request_id)


def _find_lease(owner: str, key: str) -> Flow[tuple[int, Lease] | None]:
    found = yield Stmt("LEASE_FIND", {"owner": owner, "key": key})
    lease = decide.lease_from_rows(found.rows, owner, key)
    return None if lease is None else (int(found.rows[0][0]), lease)


def _end_expired(ids: Sequence[int], reason: EndReason = EndReason.EXPIRED) -> Flow[tuple[dict[int, int], list[int]]]:
    """End the leases among ``ids`` that are still held and still expired, and give their permits back.

    Each lease is re-checked as expired under its row lock: one whose holder extended it since the caller
    read it as expired stays held (the extend was acknowledged). Returns what ``_end_locked`` returns.
    """
    locked = yield Stmt("LEASES_LOCK_EXPIRED", {"ids": sorted(ids)})
    return (yield from _end_locked(locked, reason, None))


def _end_held(ids: Sequence[int], reason: EndReason, note: str | None = None) -> Flow[tuple[dict[int, int], list[int]]]:
    """End the leases among ``ids`` that are still held, expired or not (a revoke, a dead owner, a lease
    held too long), and give their permits back. Returns what ``_end_locked`` returns."""
    # A lease ended as expired must have expired: those go through _end_expired, which re-checks it.
    assert reason not in (EndReason.EXPIRED, EndReason.SWEPT), reason
    locked = yield Stmt("LEASES_LOCK_HELD", {"ids": sorted(ids)})
    return (yield from _end_locked(locked, reason, note))


def _end_locked(locked: Result, reason: EndReason, note: str | None) -> Flow[tuple[dict[int, int], list[int]]]:
    """End the leases that a locking read found still to end. Returns the permits returned per semaphore
    id, and the ids of the leases ended. The rows were locked and re-checked first, so a lease that another
    transaction ended meanwhile is not returned twice."""
    held = sorted(int(r[0]) for r in locked.rows)
    if not held:
        return {}, []
    sums = yield Stmt("PERMITS_SUM", {"ids": held})
    returned = {int(sid): int(n) for sid, n in sums.rows}
    yield Stmt("LEASES_END", {"ids": held, "reason": str(reason), "note": note})
    # In the semaphores' name order, as PERMITS_SUM lists them: the order every grant locks their rows in,
    # so that this transaction and a grant over the same semaphores never wait on each other in a cycle.
    yield Stmt("SEM_GIVE_BACK", [{"id": sid, "count": n} for sid, n in returned.items()])
    return returned, held


# --------------------------------------------------------------------------------- release, extend, read


def release(d: Dialect, owner: str, key: str, one_semaphore: bool = False) -> Flow[ReleaseOutcome]:
    """End a held lease and give its permits back; idempotent through the ``state = held`` condition.
    ``one_semaphore``: the caller knows the lease is over one semaphore, so there is no lock order to keep
    (``RELEASE_ONE``)."""
    if d.has("RELEASE"):
        statement = "RELEASE_ONE" if one_semaphore and d.has("RELEASE_ONE") else "RELEASE"
        done = yield Stmt(statement, {"owner": owner, "key": key}, alone=True)
        if done.rowcount > 0:
            return ReleaseOutcome.RELEASED
        raise Restart(lambda: _release_cold(d, owner, key))
    else:
        ended = yield Stmt("LEASE_END_ONE", {"owner": owner, "key": key})
        if ended.rows:
            yield Stmt("SEM_GIVE_BACK_LEASE", {"lease_id": int(ended.rows[0][0])})
            return ReleaseOutcome.RELEASED
    return (yield from _release_cold(d, owner, key))


def release_own(d: Dialect, owner: str, key: str, request_id: str) -> Flow[ReleaseOutcome]:
    """``release``, only if the lease under the key records ``request_id`` (``Request.request_id``): the
    lease that request got. Any other, or none, is left alone: ``NOT_FOUND``. One that has ended is
    answered from what it is. A held one is released as ``release`` does, by key, in a transaction of its
    own; in between, the key still names that lease, since a key names one lease until the history's purge
    deletes it, a while after it ended (``keep_ended_leases``: a week by default)."""
    found = yield from find_lease(owner, key)
    if found is None or found[1] != request_id:
        return ReleaseOutcome.NOT_FOUND
    lease, _ = found
    if lease.end_reason is not None:
        return decide.release_outcome(lease)
    raise Restart(lambda: release(d, owner, key))


def _release_cold(d: Dialect, owner: str, key: str) -> Flow[ReleaseOutcome]:
    """Nothing was held and unexpired under this key: find out what there is."""
    existing = yield from _find_lease(owner, key)
    if existing is None:
        return ReleaseOutcome.NOT_FOUND
    lease_id, lease = existing
    if lease.end_reason is None:  # held, but its TTL passed: end it as expired, the holder lost it
        _, ended = yield from _end_expired([lease_id])
        if not ended:  # an extend of the lease committed since the release looked: release it after all
            raise Restart(lambda: release(d, owner, key))
        return ReleaseOutcome.LOST
    return decide.release_outcome(lease)


def extend(owner: str, key: str, ttl_ms: int | None, default_ttl_ms: int, max_ttl_ms: int | None = None) -> Flow[Lease]:
    """Push a held lease's expiry to now + ttl on the database's clock. ``ttl_ms`` ``None``: by the lease's
    own TTL (``default_ttl_ms`` for a lease granted before leases kept theirs). ``max_ttl_ms``: no further
    than that (a service's bound), whatever the TTL."""
    params = {
        "owner": owner,
        "key": key,
        "ttl_ms": ttl_ms,
        "default_ttl_ms": default_ttl_ms,
        "max_ttl_ms": max_ttl_ms,
    }
    extended = yield Stmt("LEASE_EXTEND", params)
    existing = yield from _find_lease(owner, key)
    if existing is None:
        raise LeaseNotFound(f"no lease under key {key!r} for owner {owner!r}", key=key, owner=owner)
    lease = existing[1]
    if extended.rowcount == 0:
        decide.ensure_held(lease)
        raise StorageError(f"lease {key!r} could not be extended", key=key)  # pragma: no cover - defensive
    return lease


def revoke(owner: str, key: str, note: str) -> Flow[Lease]:
    """End a lease for its holder (an administrator's force-release), recording why. The holder learns
    it at its next extend (``LeaseLost``, reason ``revoked``). A lease that has ended already is left as
    it is and returned."""
    lease, _ = yield from revoke_telling(owner, key, note, again=lambda: revoke(owner, key, note))
    return lease


def revoke_telling(
    owner: str, key: str, note: str, again: Callable[[], Flow[Any]] | None = None
) -> Flow[tuple[Lease, bool]]:
    """``revoke``, and whether this revoke is what ended the lease. The answer comes from the locked
    re-check that ends it, not from the read before: of two revokes at once, only one ends the lease, and
    only that one is an action to audit. ``again``: the caller's flow, to run anew when this one restarts
    (default: this one)."""
    existing = yield from _find_lease(owner, key)
    if existing is None:
        raise LeaseNotFound(f"no lease under key {key!r} for owner {owner!r}", key=key, owner=owner)
    lease_id, lease = existing
    if not lease.held:
        # Ended, or expired (and not yet swept or reclaimed: its permits are anyone's who asks). Nothing of
        # the holder's to end: left as it is, not relabelled as revoked.
        return lease, False
    _, ended = yield from _end_held([lease_id], EndReason.REVOKED, note)
    if not ended:
        # Ended meanwhile by another transaction (a concurrent revoke, a release). This one's reads still
        # see the lease as held on MariaDB, whose consistent reads keep the snapshot of the first: the
        # answer is read in a transaction of its own.
        raise Restart(again or (lambda: revoke_telling(owner, key, note)))
    return (yield from get_lease(owner, key)), True


def get_lease(owner: str, key: str) -> Flow[Lease]:
    existing = yield from _find_lease(owner, key)
    if existing is None:
        raise LeaseNotFound(f"no lease under key {key!r} for owner {owner!r}", key=key, owner=owner)
    return existing[1]


def holders(name: str) -> Flow[list[Holder]]:
    sem = yield Stmt("SEM_GET", {"name": name})
    if not sem.rows:
        raise SemaphoreNotFound(f"no semaphore named {name!r}", name=name)
    rows = yield Stmt("HOLDERS", {"name": name})
    return [decide.holder_from_row(r) for r in rows.rows]


# ------------------------------------------------------------------------------------------ semaphores


def create_semaphore(name: str, capacity: int, by: str, exist_ok: bool, fair: bool = False) -> Flow[Semaphore]:
    # A deleted semaphore keeps its row as a tombstone, so its fencing tokens carry on from where they
    # were: a downstream store that saw token 500 is never handed 1 again.
    revived = yield Stmt("SEM_REVIVE", {"name": name, "capacity": capacity, "fair": int(fair)})
    if revived.rowcount:
        # A place left on the tombstone (an enqueue that read the semaphore's id before the delete) would
        # hold up the new semaphore's fair queue until it lapses (PLACE_MS): the new queue starts empty.
        yield Stmt("SEM_REVIVED_WAITERS_DELETE", {"name": name})
    else:
        try:
            yield Stmt("SEM_INSERT", {"name": name, "capacity": capacity, "fair": int(fair)})
        except DuplicateKey:
            raise Restart(lambda: _existing_semaphore(name, capacity, exist_ok, fair)) from None
    sem = yield from _get(name)
    yield Stmt(
        "HISTORY_INSERT",
        {"name": name, "old": None, "new": capacity, "by": by, "reason": "created"},
    )
    return sem


def _existing_semaphore(name: str, capacity: int, exist_ok: bool, fair: bool) -> Flow[Semaphore]:
    sem = yield from _get(name)
    if exist_ok and sem.capacity == capacity and sem.fair == fair:
        return sem
    detail = "" if sem.capacity == capacity else f" with capacity {sem.capacity}"
    if sem.fair != fair:
        detail += " in fair mode" if sem.fair else " without fair mode"
    raise SemaphoreExists(f"semaphore {name!r} exists already{detail}", name=name, capacity=sem.capacity)


def get_semaphore(name: str) -> Flow[Semaphore]:
    return (yield from _get(name))


def _get(name: str) -> Flow[Semaphore]:
    found = yield Stmt("SEM_GET", {"name": name})
    if not found.rows:
        raise SemaphoreNotFound(f"no semaphore named {name!r}", name=name)
    return decide.semaphore_from_row(found.rows[0])


def list_semaphores(prefix: str) -> Flow[list[Semaphore]]:
    found = yield Stmt("SEM_LIST")
    sems = [decide.semaphore_from_row(r) for r in found.rows]
    # Filtered here rather than with LIKE: semaphores are few, and LIKE's escaping and collation rules
    # differ between the backends.
    return sorted((s for s in sems if s.name.startswith(prefix)), key=lambda s: s.name)


def set_capacity(name: str, capacity: int, by: str, reason: str) -> Flow[CapacityChange]:
    """Change a capacity with an audit record. Lowering it below use revokes nothing: acquires simply find
    no room until use drops below it."""
    locked = yield Stmt("SEMS_LOCK", {"names": [name]})
    if not locked.rows:
        raise SemaphoreNotFound(f"no semaphore named {name!r}", name=name)
    sem_id, _, old = locked.rows[0][:3]
    yield Stmt("SEM_SET_CAPACITY", {"id": int(sem_id), "capacity": capacity})
    yield Stmt("HISTORY_INSERT", {"name": name, "old": int(old), "new": capacity, "by": by, "reason": reason})
    history = yield Stmt("HISTORY_LIST", {"name": name, "limit": 1})
    return _change_from_row(history.rows[0])


def capacity_history(name: str, limit: int) -> Flow[list[CapacityChange]]:
    found = yield Stmt("HISTORY_LIST", {"name": name, "limit": limit})
    if not found.rows:
        yield from _get(name)  # raises SemaphoreNotFound for a name that never existed
    return [_change_from_row(r) for r in found.rows]


def _change_from_row(row: Sequence[Any]) -> CapacityChange:
    name, old, new, by, reason, at_ms = row[:6]
    return CapacityChange(
        name=str(name),
        old_capacity=None if old is None else int(old),
        new_capacity=int(new),
        changed_by=str(by),
        reason=str(reason),
        changed_at=ms_to_datetime(int(at_ms)),
    )


def _in_use(name: str, leases: int) -> SemaphoreInUse:
    return SemaphoreInUse(
        f"semaphore {name!r} has {leases} lease(s) holding permits; delete it with force (--force, force=true)"
        " to revoke them",
        name=name,
        leases=leases,
    )


@dataclass
class _Deleting:
    """What a forced delete carries from its first transaction to its second, and across the store's retries
    of either after a lost connection or a conflict (a retry runs the same flow again, made anew from the
    same closure). A restart after a duplicate key begins the operation anew, without it: no statement of a
    delete can meet one."""

    #: the semaphore the first transaction found: its row, and when it was made. A delete or a create
    #: afterwards changes one of them (a create under a deleted name brings the same row back, with a new
    #: created_at_ms)
    sem_id: int
    created_ms: int
    #: the leases this delete's attempts ended as revoked. Counted only where they still stand revoked
    #: (``_count_revoked``): an attempt that ended some may have rolled back
    ended: set[int] = field(default_factory=set)


def delete_semaphore(name: str, force: bool, deleting: _Deleting | None = None) -> Flow[int]:
    """Delete a semaphore; returns how many leases a forced delete revoked.

    The leases on it are ended first, in a transaction of their own, as a sweep or a revoke ends them:
    their rows, then their semaphores in name order. Ended here, under this semaphore's row lock, they would
    give back to their other semaphores after it, against the order of every grant, and a grant over those
    semaphores beside it deadlocked (1 s on PostgreSQL). Then the delete runs again (``deleting``: what the
    first transaction found and did), and ends in place only what was granted in between: going apart again
    and again, a forced delete of a busy semaphore might never finish.

    The count is of the leases this delete ended, read back from their rows at the end: the reply to either
    COMMIT may have been lost, and the store's retry then finds the leases ended, or the semaphore gone,
    and would count nothing. A lease that another delete or an administrator revoked is theirs, not this
    delete's. Should the semaphore be gone by the second transaction, or made anew under the name, this
    delete's work is done (another delete's, or its own whose reply was lost): it answers what it revoked,
    and leaves a semaphore made since alone."""
    locked = yield Stmt("SEMS_LOCK", {"names": [name]})
    row = locked.rows[0] if locked.rows else None
    if deleting is not None and (row is None or int(row[0]) != deleting.sem_id or int(row[4]) != deleting.created_ms):
        return (yield from _count_revoked(deleting.ended))
    if row is None:
        raise SemaphoreNotFound(f"no semaphore named {name!r}", name=name)
    sem_id = int(row[0])
    holding = yield Stmt("LEASES_HOLDING", {"sem_id": sem_id})
    live = [int(r[0]) for r in holding.rows if int(r[1]) > int(r[2])]  # id, expires_at_ms, now_ms
    if live and not force:
        raise _in_use(name, len(live))
    expired = sorted({int(r[0]) for r in holding.rows} - set(live))
    if deleting is None and (expired or live):
        first = _Deleting(sem_id, int(row[4]))
        raise Restart(lambda: _end_then_delete(name, force, first, expired, live))
    if expired:
        # An extend needs no semaphore row: one may have committed since the read, and its lease is live.
        _, ended = yield from _end_expired(expired)
        live += sorted(set(expired) - set(ended))
        if live and not force:
            raise _in_use(name, len(live))
    revoked: list[int] = []
    if live:
        _, revoked = yield from _end_held(live, EndReason.REVOKED)
    count = 0
    if deleting is not None:
        deleting.ended.update(revoked)
        count = yield from _count_revoked(deleting.ended)
    yield Stmt("SEM_WAITERS_DELETE", {"id": sem_id})
    yield Stmt("SEM_TOMBSTONE", {"id": sem_id})
    return count


def _end_then_delete(
    name: str, force: bool, deleting: _Deleting, expired: Sequence[int], live: Sequence[int]
) -> Flow[Then]:
    """End the leases a delete found on its semaphore (the live ones only if ``force``), and commit; then
    the delete again, ending in place only what was granted since (see ``delete_semaphore``)."""
    if expired:
        _, ended = yield from _end_expired(expired)
        live = [*live, *sorted(set(expired) - set(ended))]  # extended since the read: live after all
    if live and force:
        _, revoked = yield from _end_held(live, EndReason.REVOKED)
        deleting.ended.update(revoked)
    return Then(lambda: delete_semaphore(name, force, deleting))


def _count_revoked(ids: set[int]) -> Flow[int]:
    """How many of the leases ``ids`` stand revoked."""
    if not ids:
        return 0
    found = yield Stmt("LEASES_COUNT_REVOKED", {"ids": sorted(ids)})
    return int(found.rows[0][0])


# --------------------------------------------------------------------------------------- maintenance


def sweep_batch(limit: int) -> Flow[tuple[int, list[tuple[str, str]]]]:
    """End up to ``limit`` expired leases (oldest expiry first).

    Returns how many it found and the (owner, key) of those it ended (fewer, if others ended some first).
    """
    found = yield Stmt("EXPIRED_BATCH", {"limit": limit})
    if not found.rows:
        return 0, []
    names = {int(r[0]): (str(r[1]), str(r[2])) for r in found.rows}
    _, ended = yield from _end_expired(sorted(names), EndReason.SWEPT)
    return len(names), [names[i] for i in ended]


def leases_per_semaphore() -> Flow[dict[str, int]]:
    """How many held leases each semaphore has (for the service's gauges)."""
    found = yield Stmt("LEASES_PER_SEMAPHORE")
    return {str(name): int(n) for name, n in found.rows}


def held_owners() -> Flow[list[str]]:
    """The owners that hold leases now (held leases are few: at most the sum of the capacities)."""
    found = yield Stmt("HELD_OWNERS")
    return sorted(str(r[0]) for r in found.rows)


def end_owner_leases(owner: str, reason: EndReason, note: str, limit: int) -> Flow[list[str]]:
    """End up to ``limit`` held leases of one owner; returns their keys."""
    found = yield Stmt("HELD_BY_OWNER", {"owner": owner, "limit": limit})
    keys = {int(r[0]): str(r[1]) for r in found.rows}
    if not keys:
        return []
    _, ended = yield from _end_held(sorted(keys), reason, note)
    return [keys[i] for i in ended]


def end_stale_batch(max_age_ms: int, note: str, limit: int) -> Flow[tuple[int, list[tuple[str, str]]]]:
    """End up to ``limit`` held leases acquired more than ``max_age_ms`` ago, oldest first."""
    found = yield Stmt("HELD_OLDER_THAN", {"age_ms": max_age_ms, "limit": limit})
    if not found.rows:
        return 0, []
    names = {int(r[0]): (str(r[1]), str(r[2])) for r in found.rows}
    _, ended = yield from _end_held(sorted(names), EndReason.STALE, note)
    return len(names), [names[i] for i in ended]


def delete_ended_batch(older_than_ms: int, limit: int) -> Flow[int]:
    """Delete up to ``limit`` leases that ended more than ``older_than_ms`` ago, with their permit rows.

    Tokens are unaffected (the counter lives on the semaphore row); the keys of deleted leases can be used
    again, so this sets how long a retry is recognised as one.
    """
    found = yield Stmt("ENDED_OLDER_THAN", {"age_ms": older_than_ms, "limit": limit})
    ids = sorted(int(r[0]) for r in found.rows)
    if not ids:
        return 0
    yield Stmt("PERMITS_DELETE", {"ids": ids})
    deleted = yield Stmt("LEASES_DELETE_ENDED", {"ids": ids})
    return len(ids) if deleted.rowcount < 0 else deleted.rowcount


def delete_history_batch(older_than_ms: int, limit: int) -> Flow[int]:
    """Delete up to ``limit`` capacity changes older than ``older_than_ms``."""
    found = yield Stmt("HISTORY_OLDER_THAN", {"age_ms": older_than_ms, "limit": limit})
    ids = sorted(int(r[0]) for r in found.rows)
    if not ids:
        return 0
    yield Stmt("HISTORY_DELETE", {"ids": ids})
    return len(ids)


def find_drift() -> Flow[list[Drift]]:
    """Compare each semaphore row with its permit rows, from one snapshot: the stored count with the sum
    over held permits, the last fencing token with the highest token handed out, and the last ticket of
    its fair queue with the highest ticket a place holds."""
    found = yield Stmt("DRIFT_CHECK")
    drift: list[Drift] = []
    for _, name, used, actual, last_token, highest, orphaned, last_ticket, highest_ticket in found.rows:
        if int(used) != int(actual):
            drift.append(Drift(name=str(name), recorded=int(used), actual=int(actual)))
        if int(last_token) < int(highest):
            drift.append(Drift(name=str(name), recorded=int(last_token), actual=int(highest), field="last_token"))
        if int(orphaned):
            drift.append(Drift(name=str(name), recorded=int(orphaned), actual=0, field="orphaned_permits"))
        if int(last_ticket) < int(highest_ticket):
            drift.append(
                Drift(name=str(name), recorded=int(last_ticket), actual=int(highest_ticket), field="last_ticket")
            )
    return drift


def repair_drift(name: str, field: str = "used") -> Flow[Drift | None]:
    """Under the semaphore's row lock: store the true count (``used``), raise the token counter to the
    highest token handed out (``last_token``; never lowered), delete the permit rows whose lease is gone
    (``orphaned_permits``; their tokens stay spent), or raise the ticket counter to the highest ticket of
    the semaphore's queue (``last_ticket``; never lowered)."""
    locked = yield Stmt("SEMS_LOCK", {"names": [name]})
    if not locked.rows:
        return None
    sem_id = int(locked.rows[0][0])
    if field == "orphaned_permits":
        gone = yield Stmt("PERMITS_ORPHANED_DELETE", {"sem_id": sem_id})
        if gone.rowcount <= 0:
            return None
        return Drift(name=name, recorded=gone.rowcount, actual=0, repaired=True, field="orphaned_permits")
    if field == "last_token":
        current = yield Stmt("SEM_GET", {"name": name})
        last_token = int(current.rows[0][3])
        highest = yield Stmt("TOKEN_HIGHEST_ONE", {"sem_id": sem_id})
        top = int(highest.rows[0][0] or 0)
        if top <= last_token:
            return None
        yield Stmt("SEM_RAISE_TOKEN", {"id": sem_id, "token": top})
        return Drift(name=name, recorded=last_token, actual=top, repaired=True, field="last_token")
    if field == "last_ticket":
        counter = yield Stmt("TICKET_COUNTER_ONE", {"id": sem_id})
        last_ticket = int(counter.rows[0][0])
        highest = yield Stmt("TICKET_HIGHEST_ONE", {"sem_id": sem_id})
        top = int(highest.rows[0][0] or 0)
        if top <= last_ticket:
            return None
        yield Stmt("SEM_RAISE_TICKET", {"id": sem_id, "ticket": top})
        return Drift(name=name, recorded=last_ticket, actual=top, repaired=True, field="last_ticket")
    used = int(locked.rows[0][3])
    actual = yield Stmt("USED_ACTUAL_ONE", {"sem_id": sem_id})
    true_used = int(actual.rows[0][0] or 0) if actual.rows else 0
    if true_used == used:
        return None
    yield Stmt("SEM_SET_USED", {"id": sem_id, "used": true_used})
    return Drift(name=name, recorded=used, actual=true_used, repaired=True)


def count_held(identity: str) -> Flow[int]:
    """Held leases of one service identity: owner ``identity``, or ``identity/...``. "/" is followed by
    "0" in byte order, so the second form is the range [identity + "/", identity + "0")."""
    found = yield Stmt("LEASES_HELD_BY", {"exact": identity, "low": identity + "/", "high": identity + "0"})
    return int(found.rows[0][0])


def schema_probe() -> Flow[str | None]:
    """The schema's revision (None: no row): one cheap round trip that fails with ``SchemaMismatch`` where
    the tables are gone, so a ping reports a database that was emptied or replaced under a running client."""
    found = yield Stmt("SCHEMA_REVISION")
    return None if not found.rows else str(found.rows[0][0])
