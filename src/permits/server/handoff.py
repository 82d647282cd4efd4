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

Every attempt is the store's ordinary ``try_acquire`` for that request (its own key, owner, ttl), through
the pre-lock, so capacity, tokens and replays are exactly those of a direct attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from permits._backoff import Backoff
from permits._exceptions import ServiceUnavailable
from permits._io import monotonic
from permits._models import Lease, Want
from permits._pacing import RECHECK_SECONDS
from permits.server.prelock import PreLock, Waker
from permits.stores.base import AsyncStore

logger = logging.getLogger("permits.server")

#: Between attempts for the head of a line when nobody said that room came back. One statement per
#: semaphore per instance, whatever the number of waiters, so the cap can be short.
LINE_POLL = Backoff(base=0.005, cap=0.1)
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


@dataclass(eq=False)
class _Line:
    tickets: deque[_Ticket] = field(default_factory=deque)
    #: Set when this instance sees permits of the semaphore come back; cleared before each attempt.
    room: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    #: The store's wait for a release elsewhere (PostgreSQL's LISTEN), kept across polls: cancelling it at
    #: every poll could cancel the listener's first connect, and it would never start.
    heard: asyncio.Future[bool] | None = None
    #: When the line last handed a permit to a request (``monotonic()``).
    handed_at: float = float("-inf")


class HandOff:
    """Lines of waiting single-semaphore acquires, one per semaphore, each served by one task."""

    def __init__(self, inner: AsyncStore, prelock: PreLock, waker: Waker) -> None:
        self._inner = inner
        self._prelock = prelock
        self._waker = waker
        self._lines: dict[str, _Line] = {}

    @property
    def enabled(self) -> bool:
        # The hand-off is part of the pre-lock: with the pre-lock off, every request asks on its own.
        return self._prelock.enabled

    def queued(self, name: str) -> int:
        """Requests in ``name``'s line now (abandoned ones may still be counted until the line moves)."""
        line = self._lines.get(name)
        return 0 if line is None else len(line.tickets)

    async def wait(
        self, owner: str, key: str, want: Want, ttl_ms: int, seconds: float, rechecked_at: float | None
    ) -> Lease | None:
        """Wait in ``want.name``'s line for up to ``seconds``: the lease, or ``None`` when the time is up."""
        with self._waker.admitted():
            line = self._lines.get(want.name)
            if line is None:
                line = self._lines[want.name] = _Line()
                self._waker.watch(want.name, line.room)
            # A retry of a request that is still in the line (its reply was lost, and the client asked again
            # under the same key) takes that request's place and answer, rather than queue behind it.
            twin = next((t for t in line.tickets if (t.owner, t.key) == (owner, key) and not t.abandoned), None)
            if twin is not None:
                twin.deadline = max(twin.deadline, monotonic() + seconds)
                done, _ = await asyncio.wait({twin.future}, timeout=seconds)
                return twin.future.result() if done and not twin.future.cancelled() else None
            ticket = _Ticket(owner, key, want, ttl_ms, monotonic() + seconds, rechecked_at)
            line.tickets.append(ticket)
            if line.task is None:
                line.task = asyncio.create_task(self._serve(want.name, line), name=f"permits-line-{want.name}")
            try:
                done, _ = await asyncio.wait({ticket.future}, timeout=seconds)
                if not done and ticket.attempting:
                    await ticket.future  # granted or not, the attempt in flight is this request's answer
                return ticket.future.result() if ticket.future.done() else None
            finally:
                if not ticket.future.done():
                    ticket.abandoned = True
                    ticket.future.cancel()
                    if not ticket.attempting:  # out of the line now, so a burst of give-ups cannot pile up
                        with contextlib.suppress(ValueError):
                            line.tickets.remove(ticket)
                elif not ticket.future.cancelled():
                    ticket.future.exception()  # an answer that came as this waiter left: mark it seen

    async def _serve(self, name: str, line: _Line) -> None:
        refusals = 1  # the request that formed the line was refused just now
        waited = False
        try:
            while line.tickets:
                ticket = line.tickets[0]
                if ticket.abandoned or ticket.future.done():
                    line.tickets.popleft()
                    continue
                if self._waker.draining.is_set():
                    for waiting in line.tickets:
                        if not waiting.future.done():
                            waiting.future.set_exception(
                                ServiceUnavailable("this instance is shutting down; retry on another", limit="shutdown")
                            )
                    line.tickets.clear()
                    return
                # Ask when told of room, or when the poll is due: not straight after each grant, which on a
                # full semaphore would cost a refused attempt per hand-off.
                if not waited and not line.room.is_set():
                    delay = min(LINE_POLL.delay(refusals), max(0.0, ticket.deadline - monotonic()))
                    await self._room_or_timeout(name, line, delay)
                    waited = True
                    continue  # the head may have left meanwhile
                waited = False
                line.room.clear()
                now = monotonic()
                recheck = ticket.rechecked_at is None or now - ticket.rechecked_at >= RECHECK_SECONDS
                if recheck:
                    ticket.rechecked_at = now
                ticket.attempting = True
                try:
                    async with self._prelock.hold([name]):
                        lease = await self._inner.try_acquire(
                            ticket.owner,
                            ticket.key,
                            [ticket.want],
                            ticket.ttl_ms,
                            max(0.0, ticket.deadline - now),
                            recheck=recheck,
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
        finally:
            line.task = None
            if line.heard is not None:
                line.heard.cancel()
                line.heard = None
            if self._lines.get(name) is line:
                if line.tickets:  # a waiter arrived as the task ended (it was cancelled): serve it anew
                    if not self._waker.draining.is_set():
                        line.task = asyncio.create_task(self._serve(name, line), name=f"permits-line-{name}")
                else:
                    del self._lines[name]
                    self._waker.unwatch(name, line.room)

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
