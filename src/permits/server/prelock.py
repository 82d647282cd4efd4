"""The in-process pre-lock (seed Part 7), and in-process wake-ups.

Without it, 64 concurrent acquires of one hot semaphore on one instance would hold 64 database
connections, 63 of them waiting on the same row lock. With it, they queue here, in memory, in arrival
order (asyncio locks are FIFO), and one attempt per semaphore goes to the database at a time. Acquires
of different semaphores do not queue behind each other. A multi-semaphore acquire takes the pre-locks
in name order, the same order the database locks rows in, so two of them never wait in a cycle.

The queue wait is bounded (``prelock_wait``): past it the request gets a retryable 503, since the
database is answering that slowly.

``Waker`` wakes requests that wait for room when this instance sees permits come back (a release, a
revoke, a capacity raise). Releases through other instances are not heard here; waiters also poll with
jittered backoff, so they find that room too, a little later.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from permits._exceptions import LimitExceeded, ServiceUnavailable
from permits._io import monotonic
from permits._models import CapacityChange, Lease, ReleaseOutcome, Want
from permits.server.gone import first_of, raise_if_gone
from permits.stores.base import AsyncStore

if TYPE_CHECKING:
    from permits.server.handoff import HandOff


@dataclass
class _Queue:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holders and waiters; the entry is dropped at 0 so the map does not grow for ever


class PreLock:
    """Per-semaphore FIFO queues in memory."""

    def __init__(self, enabled: bool, max_wait: float, on_wait: Callable[[float], None] | None = None) -> None:
        self.enabled = enabled
        self.max_wait = max_wait
        self._queues: dict[str, _Queue] = {}
        self.waiting = 0
        self._on_wait = on_wait

    @contextlib.asynccontextmanager
    async def hold(self, names: Sequence[str]) -> AsyncIterator[None]:
        if not self.enabled:
            yield
            return
        ordered = sorted(set(names))
        queues = []
        for name in ordered:
            queue = self._queues.setdefault(name, _Queue())
            queue.users += 1
            queues.append(queue)
        held: list[_Queue] = []
        started = monotonic()
        self.waiting += 1
        try:
            try:
                for queue in queues:
                    if queue.lock.locked():
                        remaining = self.max_wait - (monotonic() - started)
                        await asyncio.wait_for(queue.lock.acquire(), timeout=max(0.0, remaining))
                    else:
                        # Free: taken at once. Through wait_for it would cost a task and a turn of the event
                        # loop, which a busy service makes milliseconds, on every one of a line's turns.
                        await queue.lock.acquire()
                    held.append(queue)
            except TimeoutError:
                raise ServiceUnavailable(
                    f"waited {self.max_wait:g} s in this instance's queue for {', '.join(ordered)}:"
                    " the database is answering slowly",
                    limit="prelock_wait",
                ) from None
            finally:
                self.waiting -= 1
                if self._on_wait is not None:
                    self._on_wait(monotonic() - started)
            yield
        finally:
            for queue in held:
                queue.lock.release()
            for name, queue in zip(ordered, queues, strict=True):
                queue.users -= 1
                if queue.users == 0:
                    self._queues.pop(name, None)


class Waker:
    """Requests waiting for room on a semaphore, woken when this instance sees permits come back."""

    def __init__(self, max_waiters: int) -> None:
        self.max_waiters = max_waiters
        self._waiting: dict[str, set[asyncio.Event]] = {}
        self.waiters = 0
        self.draining = asyncio.Event()

    @contextlib.contextmanager
    def admitted(self, bounded: bool = True) -> Iterator[None]:
        """Count one more request waiting for room here, within ``max_waiters``, while the block runs.
        ``bounded=False``: a request that has not been refused yet (it waits for its line's turn, not for
        room), counted but not refused, as the pre-lock's queue does not refuse it."""
        if self.draining.is_set():
            raise ServiceUnavailable("this instance is shutting down; retry on another", limit="shutdown")
        if bounded and self.waiters >= self.max_waiters:
            raise LimitExceeded(
                f"{self.max_waiters} requests are already waiting for room on this instance",
                limit="max_waiters",
            )
        self.waiters += 1
        try:
            yield
        finally:
            self.waiters -= 1

    def watch(self, name: str, event: asyncio.Event) -> None:
        """Set ``event`` whenever permits of ``name`` come back here, until ``unwatch``."""
        self._waiting.setdefault(name, set()).add(event)

    def unwatch(self, name: str, event: asyncio.Event) -> None:
        events = self._waiting.get(name)
        if events is not None:
            events.discard(event)
            if not events:
                del self._waiting[name]

    async def wait(self, names: Sequence[str], seconds: float) -> bool:
        """Wait for a local release of one of ``names`` (True) or ``seconds`` (False)."""
        with self.admitted():
            event = asyncio.Event()
            for name in names:
                self.watch(name, event)
            draining = asyncio.ensure_future(self.draining.wait())
            woken = asyncio.ensure_future(event.wait())
            try:
                await first_of({draining, woken}, seconds)
            finally:
                draining.cancel()
                woken.cancel()
                for name in names:
                    self.unwatch(name, event)
        if self.draining.is_set():
            raise ServiceUnavailable("this instance is shutting down; retry on another", limit="shutdown")
        raise_if_gone()
        return event.is_set()

    def notify_all(self) -> None:
        """Wake every waiter (permits came back somewhere, and which semaphores is not known here)."""
        for events in self._waiting.values():
            for event in events:
                event.set()

    def notify(self, names: Sequence[str]) -> None:
        for name in names:
            for event in self._waiting.get(name, ()):
                event.set()


class InstanceStore:
    """The store the service's client uses: the database store behind the pre-lock and the waker.

    Everything else passes straight through.
    """

    #: leases granted here whose semaphores are remembered, so a release here wakes the right waiters
    #: without reading the lease back
    REMEMBERED_LEASES = 100_000

    def __init__(
        self,
        inner: AsyncStore,
        prelock: PreLock,
        waker: Waker,
        on_hold: Callable[[float], None] | None = None,
    ) -> None:
        self._inner = inner
        self.prelock = prelock
        self.waker = waker
        self._on_hold = on_hold
        #: This instance's lines of waiting single-semaphore acquires (``permits.server.handoff``).
        self.handoff: HandOff | None = None
        #: (owner, key) -> (semaphore names, monotonic time of the grant)
        self._granted: OrderedDict[tuple[str, str], tuple[list[str], float]] = OrderedDict()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def default_ttl_ms(self) -> int | None:
        return None  # the service's client has the service's default (ServiceState.build)

    def queues_in_line(self, wants: Sequence[Want]) -> bool:
        return False  # this instance lines up its waiters in its own memory (handoff.py)

    async def try_acquire(
        self,
        owner: str,
        key: str,
        wants: Sequence[Want],
        ttl_ms: int,
        wait: float = 0.0,
        recheck: bool = True,
        in_line: bool = False,
        new_only: bool = False,
        request_id: str | None = None,
    ) -> Lease | None:
        if self.waker.draining.is_set():
            raise ServiceUnavailable("this instance is shutting down; retry on another", limit="shutdown")
        raise_if_gone()  # a new attempt for a client that has gone could only grant a lease nobody gets
        names = [w.name for w in wants]
        started = monotonic()
        # A request for one permit of one semaphore that is not fair waits in this instance's line. A fair
        # semaphore's waiters keep their places in the database's queue (the store knows them) and pace
        # themselves by them; larger requests wait as before, so none holds up a line's smaller ones.
        handoff = self.handoff if self.handoff is not None and self.handoff.enabled else None
        # A request for a new lease only waits in the line too, and asks alone at its turn (handoff.py).
        lined = handoff is not None and wait > 0 and len(wants) == 1 and wants[0].count == 1
        lease = None
        rechecked_at = None
        # Where a line has formed, a new request goes to its back rather than ask ahead of it; unless it is
        # a retry of one granted here, which must never wait behind the permit it holds itself: it asks at
        # once and gets that lease back. (A retry of a request still in the line shares its place there.)
        # Where the store grants in batches, such a request goes to the line at once, and the line grants the
        # requests at its head together (group commit; handoff.py). A request that holds a place in a fair
        # queue never goes to the line: the database orders it, and it does not wait in the line below either,
        # so behind a line it would not ask at all, and its place (at the head of the queue, perhaps, holding
        # up every request behind it) would lapse unasked. A request for a new lease only asks at once too, and
        # then waits in the line: a key that names another request's lease is refused now, not at its turn.
        to_line = fresh = False
        placed = self._inner.queue_short(owner, key) is not None
        if lined and handoff is not None and (owner, key) not in self._granted and not placed and not new_only:
            fresh = handoff.batches(names[0])
            to_line = fresh or handoff.queued(names[0]) > 0
        if not to_line:
            async with self.prelock.hold(names):
                lease = await self._inner.try_acquire(
                    owner, key, wants, ttl_ms, wait, recheck, new_only=new_only, request_id=request_id
                )
            rechecked_at = monotonic() if recheck else None
        remaining = wait - (monotonic() - started)
        fair = self._inner.queue_short(owner, key) is not None
        if lease is None and lined and handoff is not None and remaining > 0 and not fair:
            lease = await handoff.wait(
                owner, key, wants[0], ttl_ms, remaining, rechecked_at, fresh, new_only=new_only, request_id=request_id
            )
        if lease is not None and (owner, key) not in self._granted:
            self._granted[(owner, key)] = (names, monotonic())
            if len(self._granted) > self.REMEMBERED_LEASES:
                self._granted.popitem(last=False)
        return lease

    def wake_calls(self, names: Sequence[str]) -> int | None:
        # A waiter in a fair queue is called by the database (PostgreSQL), wherever the release ran.
        return self._inner.wake_calls(names)

    def holds_place(self, owner: str, key: str) -> bool:
        return self._inner.holds_place(owner, key)

    def place_called(self, owner: str, key: str) -> bool:
        return self._inner.place_called(owner, key)

    async def wait_for_room(self, names: Sequence[str], seconds: float, since: int | None = None) -> bool:
        if since is not None:  # the database calls this request when its turn comes: wait for that call
            heard = asyncio.ensure_future(self._inner.wait_for_room(names, seconds, since))
            try:
                await first_of({heard}, seconds)  # or the client going away (gone.py)
            finally:
                if not heard.done():
                    heard.cancel()
            raise_if_gone()
            return heard.done() and not heard.cancelled() and bool(heard.result())
        return await self.waker.wait(names, seconds)

    async def dequeue(self, owner: str, key: str) -> None:
        """Nothing here: the service's wait ended, not necessarily the client's. The route gives the place
        up unless the request asked to keep it for a retry (``keep_place``, routes.acquire_lease)."""

    async def release(
        self, owner: str, key: str, one_semaphore: bool = False, request_id: str | None = None
    ) -> ReleaseOutcome:
        # A remote client releases by key; a lease granted here is known to be over one semaphore or not.
        known = self._granted.get((owner, key))
        one_semaphore = one_semaphore or (known is not None and len(known[0]) == 1)
        # A lease over one semaphore granted here goes in the next turn of that semaphore's line, with the other
        # releases that came meanwhile and the grants they make room for (group commit, handoff.py). One the
        # turn did not release was not held: released alone, it says what it is. A release of one request's
        # lease only checks whose it is first, which a turn does not: it goes alone.
        handoff = self.handoff
        handed = None
        if request_id is None and known is not None and len(known[0]) == 1 and handoff is not None and handoff.turns:
            handed = await handoff.release(known[0][0], owner, key)
        if handed is not None:
            outcome = handed
        else:
            outcome = await self._inner.release(owner, key, one_semaphore, request_id)
            if request_id is not None and outcome is ReleaseOutcome.NOT_FOUND:
                return outcome  # another request's lease, perhaps, which this instance may still know as held
        granted = self._granted.pop((owner, key), None)
        names = None if granted is None else granted[0]
        if outcome is ReleaseOutcome.RELEASED and granted is not None and self._on_hold is not None:
            self._on_hold(monotonic() - granted[1])
        # (A turn tells this instance's waiters of room itself, once its line has taken what it needed.)
        if outcome in (ReleaseOutcome.RELEASED, ReleaseOutcome.LOST) and self.waker.waiters and handed is None:
            if names is None:  # granted by another instance: read which semaphores it held
                with contextlib.suppress(Exception):
                    names = list((await self._inner.get_lease(owner, key)).counts)
            self.waker.notify(names or [])
        return outcome

    async def revoke(self, owner: str, key: str, note: str) -> Lease:
        lease = await self._inner.revoke(owner, key, note)
        self.waker.notify(list(lease.counts))
        return lease

    async def set_capacity(self, name: str, capacity: int, by: str, reason: str) -> CapacityChange:
        change = await self._inner.set_capacity(name, capacity, by, reason)
        self.waker.notify([name])
        return change
