"""The hand-off: this instance's waiting acquires of one semaphore, served in arrival order.

Without it, every request that waits for room asks the database on its own. When a permit comes back,
every waiter on that semaphore wakes, and all but one of them are refused. Those that lose two races in a
row fall back to polling with backoff, which leaves returned permits idle while they sleep. At 64 clients
on a hot semaphore, that is most of what the service does.

With it, a request that was refused joins its semaphore's line here, and one task per line asks for the
request at the head only:
- at once when this instance sees permits of that semaphore come back (a release, a revoke, a capacity
  raise, a sweep);
- when the store's listener hears of a release elsewhere (PostgreSQL's NOTIFY);
- otherwise on a short poll, for room made where nobody tells this instance (another instance, a direct
  client, a lease that expired).

So a release here costs one attempt, for the request that has waited longest, instead of one per waiter.
The line is FIFO per instance. Across instances, the database still decides who gets a permit; a
semaphore created ``fair`` keeps its database queue, and its requests do not use a line here.

Where the store can (PostgreSQL's ``HAND_OVER``), a line works in turns, one statement and one commit each
(group commit): a turn releases the leases over that semaphore alone that were released through this
instance since the last turn, and grants the requests at the head of the line, in their order, as many as
the room then allows. A request for one permit of a plain semaphore then goes to the line at once, without
asking alone first (but for a request for a new lease only, which asks once first, and then waits in the
line, never in a turn's batch: it asks alone at its turn). On a hot semaphore every release and every
grant would otherwise write the semaphore's row and wait for its own commit, one after another behind the
row's lock; a turn writes it once for all of them, with its count checked by the database as it does for
one.

A request that a turn could not say anything about (the semaphore is fair, or gone, or a key among them has
a lease already), and the head of a line that found no room when its full recheck is due (the key's
earlier grant, expired leases to reclaim), asks alone: the store's ordinary ``try_acquire`` for that request
(its own key, owner, ttl), through the pre-lock, so capacity, tokens and replays are exactly those of a
direct attempt. A release that a turn did not release is released alone, which says what it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from permits._backoff import Backoff
from permits._deadline import CALLER_DEADLINE, caller_deadline, detached
from permits._exceptions import ServiceUnavailable, StorageUnavailable
from permits._io import monotonic
from permits._models import Lease, ReleaseOutcome, Want
from permits._pacing import RECHECK_SECONDS
from permits.server.gone import first_of, has_gone, raise_if_gone
from permits.server.prelock import PreLock, Waker
from permits.stores.base import AsyncStore

logger = logging.getLogger("permits.server")

#: Between attempts for the head of a line when nobody said that room came back. One statement per
#: semaphore per instance, whatever the number of waiters, so the cap can be short.
LINE_POLL = Backoff(base=0.005, cap=0.1)
#: At most this many requests of a line are asked for in one turn (group commit); the room left usually
#: bounds those granted first.
TURN_REQUESTS = 64
#: At most this many releases go in one turn.
TURN_RELEASES = 256
#: A turn asks for this many requests more than its semaphore's room and its releases could take.
TURN_MARGIN = 4
#: At most this many fair semaphores are remembered as such; past it the memory starts again.
REMEMBERED_FAIR = 10_000
#: How long one wait on the store's listener lasts before the line asks it again.
LISTEN_SECONDS = 1.0
#: A notification heard this soon after a hand-off here is taken for that release's own.
ECHO_SECONDS = 0.05


@dataclass(eq=False)
class _Ticket:
    owner: str
    key: str
    want: Want
    ttl_ms: int
    deadline: float
    #: When this request last ran the full recheck (its earlier grant under the key, expired leases to
    #: reclaim); ``None``: never, so its first attempt at the head runs it.
    rechecked_at: float | None
    future: asyncio.Future[Lease | None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    #: An attempt for this request is at the database now: its answer decides, even past the deadline.
    attempting: bool = False
    #: The request stopped waiting (its deadline passed, or its HTTP request was cancelled).
    abandoned: bool = False
    #: Its next attempt asks for it alone, with its full recheck: a turn could not say why it was not
    #: granted (``flows.HandedOver.ask_alone``).
    alone: bool = False
    #: when it joined the line
    joined: float = field(default_factory=monotonic)
    #: whether its key was looked up while it waited behind the head (``HandOff._answer_retries``)
    looked_up: bool = False
    #: a request for a new lease only (``flows.Request.new_only``), with its id: it takes its turn in the
    #: line, but asks alone, never in a turn's batch, whose grant would answer a key that has a lease with
    #: that lease, and records no request id
    new_only: bool = False
    request_id: str | None = None


@dataclass(eq=False)
class _Release:
    owner: str
    key: str
    #: its request's deadline (``monotonic()``; the route's, its arrival), to which the turn that carries it
    #: is held; ``None``: none
    deadline: float | None = None
    #: what became of it (``None``: a turn did not release it; release it alone), or the outage that cut it
    #: short at its deadline (see ``settle``)
    future: asyncio.Future[ReleaseOutcome | None] = field(default_factory=lambda: _future_retrieved())

    def settle(self, exc: Exception) -> None:
        """The turn failed with ``exc``: its request releases alone (``None``), which says what became of the
        lease; or, where the store gave up on the database at its deadline, its request is answered with
        that outage at once (a 503 its client sends again): a second attempt, alone and past the deadline,
        would only wait out another reply."""
        if self.future.done():
            return
        if isinstance(exc, StorageUnavailable) and self.deadline is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(None)


def _future_retrieved() -> asyncio.Future[ReleaseOutcome | None]:
    """A future whose outcome counts as seen even if its waiter was cancelled first: no "exception was never
    retrieved" in the log for a release whose request went away."""
    future: asyncio.Future[ReleaseOutcome | None] = asyncio.get_running_loop().create_future()
    future.add_done_callback(lambda done: done.cancelled() or done.exception())
    return future


@dataclass(eq=False)
class _Line:
    tickets: deque[_Ticket] = field(default_factory=deque)
    #: releases of leases over this semaphore alone, for the next turn
    releases: list[_Release] = field(default_factory=list)
    #: Set when this instance sees permits of the semaphore come back; cleared before each attempt.
    room: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    #: The store's wait for a release elsewhere (PostgreSQL's LISTEN), kept across polls: cancelling it at
    #: every poll could cancel the listener's first connect, and it would never start.
    heard: asyncio.Future[bool] | None = None
    #: When the line last handed a permit to a request (``monotonic()``).
    handed_at: float = float("-inf")
    #: The permits its semaphore had free after the line's last turn (``None``: not known): a turn asks for as
    #: many requests as that and its releases could make room for, and a few more.
    room_left: int | None = None
    #: The lookup of a waiting request's key under way (``HandOff._answer_retries``), one at a time.
    looking_up: asyncio.Task[None] | None = None


async def _attempt_decides_if_gone(ticket: _Ticket) -> None:
    """For a request whose client has gone (gone.py): let the line's attempt in flight for it end, whose
    grant is then its answer, and no more. Not its future, which a refusal leaves pending: the ticket stays
    at the head until its deadline."""
    while has_gone() and ticket.attempting and not ticket.future.done():
        await asyncio.sleep(0.005)


class HandOff:
    """Lines of waiting single-semaphore acquires, one per semaphore, each served by one task."""

    def __init__(
        self,
        inner: AsyncStore,
        prelock: PreLock,
        waker: Waker,
        on_turn: Callable[[int, int], None] | None = None,
    ) -> None:
        self._inner = inner
        self._prelock = prelock
        self._waker = waker
        #: told of each turn done: the requests it granted, the leases it released
        self._on_turn = on_turn
        self._lines: dict[str, _Line] = {}
        #: Semaphores a turn found fair: their requests ask alone, and keep their places in its queue.
        self._fair: set[str] = set()

    @property
    def enabled(self) -> bool:
        # The hand-off is part of the pre-lock: with the pre-lock off, every request asks on its own.
        return self._prelock.enabled

    def queued(self, name: str) -> int:
        """Requests in ``name``'s line now (abandoned ones may still be counted until the line moves)."""
        line = self._lines.get(name)
        return 0 if line is None else len(line.tickets)

    @property
    def turns(self) -> bool:
        """Whether lines here work in turns (group commit): where the store can (``hands_over``)."""
        return self.enabled and bool(getattr(self._inner, "hands_over", False))

    def batches(self, name: str) -> bool:
        """Whether requests for one permit of ``name`` go to its line at once, to be granted in its turns:
        where lines work in turns, and the semaphore is not known to be fair."""
        return self.turns and name not in self._fair

    async def release(self, name: str, owner: str, key: str) -> ReleaseOutcome | None:
        """Release a lease over ``name`` alone in the next turn of its line: what became of it, or ``None``
        when the turn did not release it (it was not held, or the turn failed): release it alone, which says
        what it is. A caller that stops waiting does not take it back: it goes in the turn all the same."""
        line = self._line(name)
        release = _Release(owner, key, CALLER_DEADLINE.get())
        line.releases.append(release)
        line.room.set()  # a turn is due
        self._start(name, line)
        return await asyncio.shield(release.future)

    def _line(self, name: str) -> _Line:
        line = self._lines.get(name)
        if line is None:
            line = self._lines[name] = _Line()
            self._waker.watch(name, line.room)
        return line

    def _start(self, name: str, line: _Line) -> None:
        if line.task is None:
            # It serves every waiter that comes, not only the request that started it, so not to its deadline.
            line.task = asyncio.create_task(self._serve(name, line), name=f"permits-line-{name}", context=detached())

    async def wait(
        self,
        owner: str,
        key: str,
        want: Want,
        ttl_ms: int,
        seconds: float,
        rechecked_at: float | None,
        fresh: bool = False,
        new_only: bool = False,
        request_id: str | None = None,
    ) -> Lease | None:
        """Wait in ``want.name``'s line for up to ``seconds``: the lease, or ``None`` when the time is up.
        ``fresh``: the request has not asked yet; one that finds nobody waiting is asked for at once.
        A request for a new lease only (``new_only``) waits its turn in the line like any other, and then asks
        alone: a turn's batch grant (``HAND_OVER``) would answer a key that has a lease with that lease, and
        records no request id. Outside the line it starved: the turns took every permit that came back
        (docs/benchmarks.md)."""
        # A fresh request that finds nobody waiting is not refused for the number of waiters: it is likely to
        # be granted in the turn that follows at once, as it would have been asking alone.
        existing = self._lines.get(want.name)
        tickets = () if existing is None else existing.tickets
        first = fresh and not any(not t.abandoned and not t.future.done() for t in tickets)
        with self._waker.admitted(bounded=not first):
            line = self._line(want.name)
            # A retry of a request that is still in the line (its reply was lost, and the client asked again
            # under the same key) takes that request's place and answer, rather than queue behind it. Not one
            # whose waiter was cancelled (its future with it) as the line has yet to drop it: that has no answer
            # to share, and the retry would be told "no room" at once, each time, until the line moved.
            # A request for a new lease only shares only its own request's place (the same request id), and a
            # plain request never shares one's: their answers to a key that names a lease differ.
            twin = next(
                (
                    t
                    for t in line.tickets
                    if (t.owner, t.key) == (owner, key)
                    and not t.abandoned
                    and not t.future.done()
                    and t.new_only == new_only
                    and (not new_only or (request_id is not None and t.request_id == request_id))
                ),
                None,
            )
            if twin is not None:
                twin.deadline = max(twin.deadline, monotonic() + seconds)
                await first_of({twin.future}, seconds)
                await _attempt_decides_if_gone(twin)
                if not twin.future.done() and (twin.attempting or (twin.alone and not has_gone())):
                    # As its own waiter would (below): the attempt under way decides. Shielded: the future is
                    # the request's own, and this retry's cancellation must not end it.
                    await asyncio.wait({asyncio.shield(twin.future)})
                lease = twin.future.result() if twin.future.done() and not twin.future.cancelled() else None
                if lease is None and twin.rechecked_at is None:
                    raise_if_gone()
                    lease = await self._ask_last(twin)
                return lease
            ticket = _Ticket(
                owner, key, want, ttl_ms, monotonic() + seconds, rechecked_at, new_only=new_only, request_id=request_id
            )
            if first:
                line.room.set()  # nobody waits for room: there may be some
            line.tickets.append(ticket)
            self._start(want.name, line)
            try:
                # Until the answer, the time is up, or the client goes away (gone.py).
                await first_of({ticket.future}, seconds)
                await _attempt_decides_if_gone(ticket)
                if not ticket.future.done() and (ticket.attempting or (ticket.alone and not has_gone())):
                    # Granted or not, the attempt in flight, or the one a turn left it to make, is its answer;
                    # for a client that has gone, only one in flight: nobody needs the other's answer.
                    await ticket.future
                lease = ticket.future.result() if ticket.future.done() else None
                if lease is not None or ticket.rechecked_at is not None:
                    return lease
            finally:
                if not ticket.future.done():
                    ticket.abandoned = True
                    ticket.future.cancel()
                    if not ticket.attempting:  # out of the line now, so a burst of give-ups cannot pile up
                        with contextlib.suppress(ValueError):
                            line.tickets.remove(ticket)
                elif not ticket.future.cancelled():
                    ticket.future.exception()  # an answer that came as this waiter left: mark it seen
        raise_if_gone()
        return await self._ask_last(ticket)

    async def _ask_last(self, ticket: _Ticket) -> Lease | None:
        """One attempt alone, with the full recheck and no wait, for a request about to be answered "no room"
        that never had one. Its key may hold a lease already: granted by an attempt whose answer was lost, the
        client's retry came to this line as a new request, and a turn that finds no room cannot see that lease
        (the lease's own permit may be the room it lacks). It is found here, or the answer is a checked one."""
        async with self._prelock.hold([ticket.want.name]):
            return await self._inner.try_acquire(
                ticket.owner,
                ticket.key,
                [ticket.want],
                ticket.ttl_ms,
                0.0,
                recheck=True,
                new_only=ticket.new_only,
                request_id=ticket.request_id,
            )

    async def _serve(self, name: str, line: _Line) -> None:
        refusals = 1  # the request that formed the line was refused just now
        waited = False
        try:
            while line.tickets or line.releases:
                if line.tickets and (line.tickets[0].abandoned or line.tickets[0].future.done()):
                    line.tickets.popleft()
                    continue
                if self._waker.draining.is_set() and line.tickets:
                    for waiting in line.tickets:
                        if not waiting.future.done():
                            waiting.future.set_exception(_drained(waiting))
                    line.tickets.clear()
                    continue  # the releases still go
                if not line.tickets:  # releases only
                    line.room.clear()
                    await self._turn(name, line, [])
                    continue
                ticket = line.tickets[0]
                # Ask when told of room (releases here are room, and due in a turn), or when the poll is due:
                # not straight after each grant, which on a full semaphore would cost a refused attempt per
                # hand-off.
                if not waited and not line.room.is_set():
                    delay = min(LINE_POLL.delay(refusals), max(0.0, ticket.deadline - monotonic()))
                    await self._room_or_timeout(name, line, delay)
                    waited = True
                    continue  # the head may have left meanwhile
                waited = False
                line.room.clear()
                now = monotonic()
                recheck = ticket.rechecked_at is None or now - ticket.rechecked_at >= RECHECK_SECONDS
                batch = self._batch(name, line)
                if len(batch) > 1 or line.releases:
                    if await self._turn(name, line, batch):
                        refusals = 0
                        line.handed_at = monotonic()
                        continue
                    # No room: the head asks alone (which reclaims expired leases) when its recheck is due.
                    if batch and (not recheck or ticket.future.done()):
                        refusals += 1
                        self._answer_retries(line)
                        continue
                    if ticket.future.done():
                        continue
                if recheck:
                    ticket.rechecked_at = now
                ticket.attempting = True
                ticket.alone = False
                try:
                    # An attempt for the head alone: held to its request's deadline, as the request's own work
                    # is (the line itself is not, permits._deadline).
                    with caller_deadline(ticket.deadline):
                        async with self._prelock.hold([name]):
                            lease = await self._inner.try_acquire(
                                ticket.owner,
                                ticket.key,
                                [ticket.want],
                                ticket.ttl_ms,
                                max(0.0, ticket.deadline - now),
                                recheck=recheck,
                                new_only=ticket.new_only,
                                request_id=ticket.request_id,
                            )
                except Exception as exc:  # the request's own error (a conflict, an outage): it answers with it
                    line.tickets.popleft()
                    if not ticket.future.done():
                        ticket.future.set_exception(exc)
                    continue
                finally:
                    ticket.attempting = False
                if lease is not None:
                    line.tickets.popleft()
                    refusals = 0
                    line.handed_at = monotonic()
                    if not ticket.future.done():
                        ticket.future.set_result(lease)
                    else:
                        # Its waiter was cancelled while the grant was on its way: the lease is held until
                        # its TTL, and a retry under the key gets it back.
                        logger.info("lease %r of %r granted after its request was cancelled", ticket.key, name)
                    continue
                if monotonic() >= ticket.deadline:  # its time is up: answer its waiter, which may be waiting
                    line.tickets.popleft()  # on this very attempt
                    if not ticket.future.done():
                        ticket.future.set_result(None)
                    continue
                if self._inner.queue_short(ticket.owner, ticket.key) is not None:
                    # It holds a place in a fair queue after all: the database orders it, and the client's
                    # loop paces it by that place.
                    line.tickets.popleft()
                    if not ticket.future.done():
                        ticket.future.set_result(None)
                    continue
                refusals += 1
                self._answer_retries(line)
        finally:
            line.task = None
            if line.heard is not None:
                line.heard.cancel()
                line.heard = None
            if self._lines.get(name) is line:
                if line.tickets or line.releases:
                    # Something arrived as the task ended (it was cancelled): serve it anew; or, shutting down,
                    # tell releases to go alone.
                    if not self._waker.draining.is_set():
                        self._start(name, line)
                    else:
                        for release in line.releases:
                            if not release.future.done():
                                release.future.set_result(None)
                        line.releases.clear()
                else:
                    del self._lines[name]
                    self._waker.unwatch(name, line.room)

    def _answer_retries(self, line: _Line) -> None:
        """Answer the retries waiting behind a head that finds no room. A request whose reply was lost is
        asked again, through another instance perhaps, where it joins the line as a new request: behind a
        head that may be waiting for that very lease's permit, it would wait out its whole time (and the
        head its own) before its turn found the lease. So a request that has waited ``RECHECK_SECONDS``
        behind the head has its key looked up once, a read, in a task of its own, one at a time per line, so
        that the line's turns and releases never wait for it. A lease held under it for the same want is its
        answer; anything else (no lease, one for other wants) waits for its turn as before."""
        if line.looking_up is not None and not line.looking_up.done():
            return
        now = monotonic()
        for ticket in itertools.islice(line.tickets, 1, None):
            if now - ticket.joined < RECHECK_SECONDS:
                return  # nor any behind it: the line is in the order they joined
            if ticket.looked_up or ticket.future.done() or ticket.abandoned or ticket.attempting:
                continue
            if ticket.new_only:
                continue  # a lease under its key is its answer only if its own request got it: its turn says
            if ticket.rechecked_at is not None:
                continue  # it has asked with its full recheck already: a lease under its key was not there
            ticket.looked_up = True
            line.looking_up = asyncio.ensure_future(self._look_up(line, ticket))
            return

    async def _look_up(self, line: _Line, ticket: _Ticket) -> None:
        try:
            lease = await self._inner.get_lease(ticket.owner, ticket.key)
        except Exception:  # not found, or the database: its turn will tell
            return
        if not lease.held or lease.counts != {ticket.want.name: ticket.want.count} or ticket.future.done():
            return
        if ticket.attempting or (line.tickets and line.tickets[0] is ticket):
            return  # it is being asked for, or is the head now: the line's own attempt answers it
        with contextlib.suppress(ValueError):
            line.tickets.remove(ticket)
        ticket.future.set_result(lease)

    def _batch(self, name: str, line: _Line) -> list[_Ticket]:
        """The requests at the head of the line that a turn asks for, up to the first that must ask alone;
        none where lines do not work in turns, or the semaphore is fair."""
        batch: list[_Ticket] = []
        if not self.batches(name):
            return batch
        # As many as the room could take, with a margin for permits that came back elsewhere (an expiry,
        # another instance): asked for, a request costs the turn a little even when it is not granted.
        # Fewer than the room takes only cost a turn more, which follows at once.
        most = TURN_REQUESTS
        if line.room_left is not None:
            most = min(most, line.room_left + len(line.releases) + TURN_MARGIN)
        for ticket in line.tickets:
            if ticket.abandoned or ticket.future.done():
                continue
            if ticket.alone or ticket.new_only or len(batch) >= most:
                break
            batch.append(ticket)
        return batch

    async def _turn(self, name: str, line: _Line, batch: list[_Ticket]) -> bool:
        """One turn: the releases gathered so far, and as many of ``batch`` as there is room for then, in
        order, in one statement; answer them (and the requests whose time is up meanwhile). Whether the line
        moved: a request was granted; or the turn could not say why it granted none, and they ask alone now;
        or it failed, and every request in it answers with that error, as a request asking alone would (a
        release in it is released alone)."""
        releases, line.releases = line.releases[:TURN_RELEASES], line.releases[TURN_RELEASES:]
        if line.releases:
            line.room.set()  # the rest go in the next turn
        if len(releases) == 1 and not batch:
            # One release and nothing to grant: the release's own statement is the cheaper one.
            await self._release_alone(name, releases[0])
            return False
        for ticket in batch:
            ticket.attempting = True
        # A turn is held to the latest of its requests' deadlines (permits._deadline): over a link that hangs,
        # its waiters would otherwise wait out every retry's reply deadline, and its releases' requests, held
        # to their own (routes.release_lease), would be answered only then. Not to an earlier one: a release
        # must not be cut short for a waiter's timeout, nor a grant for a release's. A release with no
        # deadline holds the turn to none.
        held_to = [r.deadline for r in releases if r.deadline is not None]
        turn_deadline = max([t.deadline for t in batch] + held_to) if len(held_to) == len(releases) else None
        try:
            with caller_deadline(turn_deadline):
                async with self._prelock.hold([name]):
                    handed = await self._inner.hand_over(  # type: ignore[attr-defined]
                        name,
                        [(r.owner, r.key) for r in releases],
                        [(t.owner, t.key, t.ttl_ms) for t in batch],
                        max(0.0, batch[0].deadline - monotonic()) if batch else None,
                    )
        except Exception as exc:
            for release in releases:
                release.settle(exc)
            for ticket in batch:
                self._answer(line, ticket, error=exc)
            return bool(batch)
        finally:
            for ticket in batch:
                ticket.attempting = False
        if self._on_turn is not None:
            self._on_turn(sum(lease is not None for lease in handed.leases), sum(handed.released))
        for release, released in zip(releases, handed.released, strict=True):
            if not release.future.done():
                release.future.set_result(ReleaseOutcome.RELEASED if released else None)
        if handed.fair:
            self._remember_fair(name)
        granted = 0
        now = monotonic()
        for ticket, lease in zip(batch, handed.leases, strict=True):
            if lease is not None:
                granted += 1
                if ticket.future.done():
                    # Its waiter was cancelled while the grant was on its way: the lease is held until its
                    # TTL, and a retry under the key gets it back.
                    logger.info("lease %r of %r granted after its request was cancelled", ticket.key, name)
                self._answer(line, ticket, lease)
            elif handed.ask_alone:
                # The turn cannot say why: its key may have a lease already, granted by this very turn in a
                # commit whose reply was lost and found by the store's retry. "No room" could then be false
                # (the permit held by nobody until its TTL), so it asks alone with its full recheck, even
                # past its deadline, and its waiter waits for that answer.
                ticket.alone = True
                ticket.rechecked_at = None
            elif now >= ticket.deadline:  # its time is up: its waiter may be waiting on this very attempt
                self._answer(line, ticket, None)
        line.room_left = handed.room
        room_left = handed.room is None or handed.room > 0
        if handed.ask_alone or (granted == len(batch) and room_left):
            # Those that must ask alone do so now; and where every request was granted and room is left, it is
            # for those that came meanwhile, and for waiters elsewhere on this instance.
            line.room.set()
            if not handed.ask_alone:
                self._waker.notify([name])
        return granted > 0 or (handed.ask_alone and bool(batch))

    async def _release_alone(self, name: str, release: _Release) -> None:
        try:
            with caller_deadline(release.deadline):  # its request's, as a turn is held to (see _turn)
                outcome = await self._inner.release(release.owner, release.key, True)
        except Exception as exc:
            release.settle(exc)  # its caller releases it alone, and meets the error itself; or the outage
            return
        if not release.future.done():
            release.future.set_result(outcome)
        if outcome in (ReleaseOutcome.RELEASED, ReleaseOutcome.LOST):
            self._waker.notify([name])

    def _remember_fair(self, name: str) -> None:
        if len(self._fair) >= REMEMBERED_FAIR:
            self._fair.clear()
        self._fair.add(name)

    @staticmethod
    def _answer(line: _Line, ticket: _Ticket, lease: Lease | None = None, error: Exception | None = None) -> None:
        """Take ``ticket`` out of the line and give its waiter the lease, ``None`` (no room in its time) or
        the error."""
        with contextlib.suppress(ValueError):
            line.tickets.remove(ticket)
        if not ticket.future.done():
            if error is not None:
                ticket.future.set_exception(error)
            else:
                ticket.future.set_result(lease)

    async def _room_or_timeout(self, name: str, line: _Line, seconds: float) -> None:
        """Until this instance sees room come back, the store's listener hears of a release, or ``seconds``."""
        deadline = monotonic() + seconds
        while not line.room.is_set() and (left := deadline - monotonic()) > 0:
            if line.heard is None:
                line.heard = asyncio.ensure_future(self._inner.wait_for_room([name], LISTEN_SECONDS))
            local: asyncio.Future[Any] = asyncio.ensure_future(line.room.wait())
            heard: asyncio.Future[Any] = line.heard
            try:
                await asyncio.wait({local, heard}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                local.cancel()
            if not heard.done():
                return
            line.heard = None
            if heard.cancelled() or heard.exception() is not None or not heard.result():
                continue  # a failed or idle wait is only a missed wake-up: the poll covers it
            if monotonic() - line.handed_at > ECHO_SECONDS:
                return
            # Heard just after a hand-off here: most likely the notification of that very release, whose
            # permit is taken. Asking again would be refused; a release elsewhere is found by the poll.


def _drained(ticket: _Ticket) -> Exception:
    """The answer to a request still in the line when the instance shuts down. "Not carried out"
    (``service_unavailable``), unless a turn may have granted it, unseen (``alone``: the turn could not
    say why it was not granted, see ``flows.HandedOver.ask_alone``): then its outcome is unknown
    (``storage_unavailable``), and a retry on another instance, under the same key, gets its lease."""
    if ticket.alone:
        return StorageUnavailable(
            "this instance is shutting down, and a turn may have granted this request unseen: retry on another"
            " with the same key"
        )
    return ServiceUnavailable("this instance is shutting down; retry on another", limit="shutdown")
