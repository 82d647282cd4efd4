"""The lease watchdog: keeps a lease alive while its holder works, and says so at once when it is lost.

It extends the lease about every ttl/3, on the database's clock. When an extend finds the lease gone
(released, expired, swept, revoked), the holder is told at once and never silently: ``lost`` is set,
``on_lost`` is called with the reason, and in asyncio code the guarded task (the one that started the
watchdog) is cancelled. A failed extend that is not a verdict (the database is unreachable) is retried
until the lease's own expiry, as last measured by the database, has passed; then the lease is lost as
``expired``, at that moment, even while an extend still waits for its answer (a database that hangs holds
the extend, not the verdict). With ``max_hold``, extends stop making the lease outlive that many seconds
from the start; it then runs out, and is reported lost with reason ``max_hold``.

The sync twin (generated) runs the same loop on a daemon thread; threads cannot be cancelled, so the sync
holder learns of a loss through ``lost`` and ``on_lost``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from permits._exceptions import LeaseLost, LeaseNotFound, PermitsError
from permits._io import (
    async_cancelling,
    async_current,
    async_event,
    async_interrupt,
    async_join,
    async_mutex,
    async_spawn,
    async_take_back_cancel,
    async_wait,
    monotonic,
)
from permits._models import Lease

if TYPE_CHECKING:
    from permits._async.client import AsyncClient

logger = logging.getLogger("permits.watchdog")

#: The reason given when ``max_hold`` ran out.
MAX_HOLD = "max_hold"
#: The reasons of a lease that ran out at its expiry, no earlier (a sweep ends only an expired lease).
RAN_OUT = frozenset({"expired", "swept"})


class AsyncWatchdog:
    """Extends ``lease`` every ``ttl / 3`` seconds until stopped; see the module docstring.

    :param ttl: each extend sets the lease to expire this many seconds later (default: its current TTL).
    :param max_hold: the most seconds, from now, that the lease may be kept alive.
    :param on_lost: called with the reason (``revoked``, ``expired``, ``max_hold``...) when it is lost.
    :param cancel: in asyncio code, cancel the task that started the watchdog when the lease is lost.
    :param counted_from: when the request that got ``lease`` was sent, on this process's monotonic clock
        (default: now). The database started the lease's TTL no earlier, perhaps after the request waited
        for the semaphore's row, so counting from here the watchdog never thinks the lease outlives the
        database's expiry.
    """

    def __init__(
        self,
        client: AsyncClient,
        lease: Lease,
        *,
        ttl: float | None = None,
        max_hold: float | None = None,
        on_lost: Callable[[str], Any] | None = None,
        cancel: bool = True,
        counted_from: float | None = None,
    ) -> None:
        self._client = client
        self.lease = lease
        #: when the lease runs out as far as this process can tell (monotonic), at the latest: moved on by
        #: each extend, counted from before its request
        self.deadline = (monotonic() if counted_from is None else counted_from) + lease.expires_in
        # The lease's own TTL; for one granted before the database kept TTLs, the time its grant or last
        # extend gave it (which a retry's or an earlier watchdog's extends may have lengthened).
        own = lease.ttl if lease.ttl is not None else (lease.expires_at - lease.acquired_at).total_seconds()
        self.ttl = ttl if ttl is not None else max(0.003, own)
        self.max_hold = max_hold
        self._on_lost = on_lost
        self._cancel = cancel
        #: set when the lease is lost; ``reason`` says why
        self.lost = async_event()
        self.reason: str | None = None
        self._stop = async_event()
        self._losing = async_mutex()
        self._guarded: Any = None
        #: the guarded task's pending cancellations when the watchdog started, and whether it cancelled it
        self._cancelling_before = 0
        self._cancelled_guarded = False
        self._runner: Any = None
        self._expiry: Any = None
        self._started = 0.0
        #: when the holder stopped the watchdog (monotonic): its work was done by then
        self._stopped_at: float | None = None
        #: the last extend was cut short to end the lease at max_hold
        self._held_to_the_end = False

    def __repr__(self) -> str:
        if self.lost.is_set():
            state = f"lost ({self.reason})"
        else:
            state = "stopped" if self._stop.is_set() else "watching" if self._runner is not None else "not started"
        return f"<{type(self).__name__} lease={self.lease.key!r} ttl={self.ttl:g} {state}>"

    async def start(self) -> AsyncWatchdog:
        self._started = monotonic()
        self._guarded = async_current() if self._cancel else None
        self._cancelling_before = async_cancelling(self._guarded)
        self._cancelled_guarded = False
        self._runner = async_spawn(self._run, "permits-watchdog")
        self._expiry = async_spawn(self._guard_expiry, "permits-watchdog-expiry")
        return self

    def stopping(self) -> None:
        """Say that the holder is done, before anything awaits: a loss found from now on cancels nothing (the
        cancel would land in the holder's exit, not in its work). ``stop`` starts with it."""
        if self._stopped_at is None:
            self._stopped_at = monotonic()
        self._stop.set()

    async def stop(self) -> None:
        """Stop extending (the lease stays as it is; release it separately)."""
        self.stopping()
        for runner in (self._runner, self._expiry):
            if runner is not None:
                await async_join(runner)

    async def __aenter__(self) -> AsyncWatchdog:
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            await self.stop()
        except BaseException as exc:  # cancelled while stopping: this watchdog's own cancel is taken back
            self.lost_in_place_of(exc)
            raise
        lost = self.lost_in_place_of(exc_info[1])
        if lost is not None:
            raise lost from exc_info[1]

    def lost_in_place_of(self, exc: BaseException | None) -> LeaseLost | None:
        """At the end of the guarded block, which ended with ``exc``: the ``LeaseLost`` to raise in place of
        the cancellation this watchdog caused, as ``asyncio.timeout()`` raises ``TimeoutError`` in place of
        its own. A bare ``CancelledError`` out of a block would tell the caller nothing, and its task's
        ``cancelling()`` would stay raised, so an ``asyncio.timeout()`` around it would never fire. ``None``
        when the watchdog cancelled nothing, or when another cancellation came too (that one stays)."""
        if not self._cancelled_guarded:
            return None
        self._cancelled_guarded = False
        if not async_take_back_cancel(self._guarded, self._cancelling_before, exc):
            return None
        return LeaseLost(
            f"lease {self.lease.key!r} lost ({self.reason}) while its block ran: the block was cancelled",
            key=self.lease.key,
            owner=self.lease.owner,
            reason=self.reason,
        )

    async def _run(self) -> None:
        # Every ttl/3, and sooner while the deadline is close: a grant that waited long for its row, or an
        # extend that failed, leaves less than a TTL.
        while not await async_wait(self._stop, min(self.ttl / 3, max(0.001, (self.deadline - monotonic()) / 2))):
            ttl = self.ttl
            if self.max_hold is not None:
                ttl = min(ttl, self._started + self.max_hold - monotonic())
                # Keep no longer than max_hold: let the lease run out, then say it is gone. The extend that
                # reached max_hold is the last: after it, each would ask for half the time left, down to
                # less than a round trip, and the lease would run out under its own extend (reported as
                # expired, not max_hold).
                if ttl < 0.001 or self._held_to_the_end:
                    if await async_wait(self._stop, self.deadline - monotonic()):
                        return
                    await self._lose(MAX_HOLD, f"max_hold of {self.max_hold:g} s reached")
                    return
            asked = monotonic()
            try:
                # Bounded by the lease's deadline: past it the lease is lost (_guard_expiry says so), and an
                # extend still waiting on a link that hangs would only linger, retried for minutes.
                extended = await self._client.extend(self.lease, ttl, timeout=max(0.0, self.deadline - asked))
                if self.lost.is_set():
                    return  # its answer came too late: the lease was given up for lost at its deadline
                self.lease = extended
            except (LeaseLost, LeaseNotFound) as exc:
                await self._lose(str(exc.details.get("reason") or "not_found"), str(exc))
                return
            except PermitsError as exc:  # the database may answer again before the lease runs out
                logger.warning("could not extend lease %r: %s", self.lease.key, exc)
                if monotonic() >= self.deadline:
                    await self._lose("expired", f"could not extend before it expired: {exc}")
                    return
                continue
            # Measured from before the request: the database's clock started the new TTL no earlier.
            self.deadline = asked + self.lease.expires_in
            self._held_to_the_end = ttl < self.ttl

    async def _guard_expiry(self) -> None:
        """Lose the lease the moment its deadline passes without an extend, whatever the extending loop is
        doing: an extend that waits for a hung database must not let the holder work on past the expiry
        (say, a command that `permits run` protects, which gets its signal at the deadline). An extend that
        succeeds moves the deadline on first."""
        while not await async_wait(self._stop, self.deadline - monotonic()):
            if self.lost.is_set():
                return
            if monotonic() >= self.deadline:
                if self._held_to_the_end or (
                    self.max_hold is not None and monotonic() >= self._started + self.max_hold
                ):
                    await self._lose(MAX_HOLD, f"max_hold of {self.max_hold:g} s reached")
                else:
                    await self._lose("expired", "not extended before it expired: the extend had no answer in time")
                return

    async def _lose(self, reason: str, message: str) -> None:
        if reason in RAN_OUT and self._stopped_at is not None and self._stopped_at < self.deadline:
            # An extend that hung until after the holder stopped us, and then found the lease expired (or
            # swept once it had): it ran out no earlier than the deadline, so it was held for all of the
            # holder's work, which is not what a loss tells (`permits run` would report a command that ended
            # in time as unprotected).
            logger.debug("lease %r ran out after its holder was done: %s", self.lease.key, message)
            return
        with self._losing:  # the extending loop and the expiry guard may both find it lost: say it once
            if self.lost.is_set():
                return
            self.reason = reason
            self.lost.set()
        logger.warning("lease %r lost: %s", self.lease.key, message)
        if self._on_lost is not None:
            try:
                self._on_lost(reason)
            except Exception:
                logger.exception("the on_lost callback of lease %r failed", self.lease.key)
        if self._stopped_at is None:
            # Not once the holder has stopped the watchdog: its block is over, and a cancel would land in its
            # exit instead, between the stop and the release, and skip the release.
            self._cancelled_guarded = async_interrupt(self._guarded)
