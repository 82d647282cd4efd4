"""The client: validates input, picks defaults, waits for room, and hands each attempt to a store."""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from permits import _validate
from permits._async.watchdog import AsyncWatchdog
from permits._backoff import OUTAGE_BACKOFF
from permits._config import DEFAULT_LOCK_WAIT_TIMEOUT, DEFAULT_RETRIES, Settings
from permits._deadline import caller_deadline
from permits._exceptions import (
    ENDS_THE_REQUEST,
    AcquireTimeout,
    LeaseLost,
    PermitsError,
    ServiceUnavailable,
    StorageConflict,
    StorageUnavailable,
    UsageError,
)
from permits._io import async_lock, async_shield, async_sleep, async_try_lock, monotonic
from permits._models import (
    RWLOCK_READERS,
    CapacityChange,
    Drift,
    Holder,
    Lease,
    ReleaseOutcome,
    Semaphore,
    SweepResult,
    Waiter,
    Want,
)
from permits._pacing import CALLED_MAX_SLEEP, WaitPacer
from permits._validate import Seconds, WantsLike
from permits.stores import async_store_for
from permits.stores.base import AsyncStore

if TYPE_CHECKING:  # not imported otherwise: a client of a service needs no SQLAlchemy
    from sqlalchemy.engine import URL

logger = logging.getLogger("permits.client")

#: With no timeout, how long one attempt may wait for room in a store that can wait (the service).
LONG_POLL_SECONDS = 30.0
#: The time an ``acquire`` whose timeout has run out gives its last attempt: not none, which would make it a
#: try, whose wait for a lock another session holds is the whole lock wait (5 s by default) rather than what
#: is left of the caller's time (see ``try_acquire``'s lock wait in the store).
LAST_ATTEMPT_SECONDS = 0.001
#: What a waiting acquire rides out, within its timeout (see ``_acquire``).
UNAVAILABLE = (StorageUnavailable, ServiceUnavailable)
#: The attribute set on the interruption (CancelledError, KeyboardInterrupt) of an acquire that was riding
#: out an outage: its clean-up is left to the TTL (see ``_acquire``).
INTERRUPTED_IN_OUTAGE = "_permits_interrupted_in_outage"
#: How many sets of semaphore names a client remembers the contention of.
REMEMBERED_CONTENTION = 1024


class AsyncClient:
    """A connection to permits.

    ``url`` picks the backend: ``sqlite:///permits.db`` (the default, embedded), ``mysql://`` or
    ``mariadb://``, ``postgresql://``, or a permits service at ``http://`` or ``https://`` (the same
    interface, over HTTP); ``None`` reads ``$PERMITS_DATABASE_URL``.

    :param owner: the identity that scopes lease keys (default ``$PERMITS_OWNER``, else ``user@host``).
    :param ttl: the TTL, in seconds, of a lease acquired without one. Default: 60, or through a service
        the service's default (60, or its ``max_ttl`` if lower).
    :param lock_wait_timeout: how long one transaction may wait for a row lock before it is retried.
    :param retries: how many times a transaction is retried after a deadlock, a serialization failure, a
        busy database or a lost connection.
    :param auto_upgrade: create or upgrade the schema on first use (default: only for SQLite).
    :param token: the bearer token when ``url`` is a permits service (``http://`` or ``https://``);
        default ``$PERMITS_TOKEN``.
    :param reply_timeout: how long an operation's statement or transaction may wait for its answer before
        its connection is taken as lost and the operation retried (a stalled link, a hung server); more than
        twice ``lock_wait_timeout``. Default: twice ``lock_wait_timeout`` plus 10 s.
    :param store: a store to use instead of the one ``url`` picks (see ``permits.stores``); the service
        passes its database store wrapped in its in-memory queue.
    """

    def __init__(
        self,
        url: str | URL | None = None,
        *,
        owner: str | None = None,
        ttl: float | None = None,
        lock_wait_timeout: float = DEFAULT_LOCK_WAIT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        auto_upgrade: bool | None = None,
        token: str | None = None,
        reply_timeout: float | None = None,
        store: AsyncStore | None = None,
    ) -> None:
        self._settings = Settings.build(
            url,
            owner=owner,
            ttl=ttl,
            lock_wait_timeout=lock_wait_timeout,
            retries=retries,
            auto_upgrade=auto_upgrade,
            token=token,
            reply_timeout=reply_timeout,
        )
        self._store = async_store_for(self._settings) if store is None else store
        self._closed = False
        #: whether a waiting acquire waits through an outage (see ``_acquire``); not in a service's own client,
        #: which answers its callers at once (503), and they wait, or go to another instance
        self._rides_out_outages = True
        #: semaphore names -> (races lost by its last waiter, no listening until) (see ``permits._pacing``)
        self._contention: dict[tuple[str, ...], tuple[int, float]] = {}

    def __repr__(self) -> str:
        # The URL without its password, as everywhere else this client names it.
        return f"<{type(self).__name__} {self.url!r} owner={self.owner!r}{' closed' if self._closed else ''}>"

    @property
    def owner(self) -> str:
        """The default owner of this client's leases."""
        return self._settings.owner

    @property
    def default_ttl(self) -> float:
        """The TTL, in seconds, of a lease acquired without one: ``connect``'s ``ttl``, else through a service
        the service's default (known once the client is open), else 60."""
        return self._default_ttl_ms() / 1000

    def _default_ttl_ms(self) -> int:
        store_default = self._store.default_ttl_ms
        return self._settings.ttl_ms if self._settings.ttl_chosen or store_default is None else store_default

    @property
    def url(self) -> str:
        """The database URL, without its password."""
        return self._store.url

    async def __aenter__(self) -> AsyncClient:
        await self._store.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool. Held leases stay held until released or expired."""
        if not self._closed:
            self._closed = True
            try:
                await self._store.close()
            except UsageError:  # from another event loop than its own, which is still open: not closed
                self._closed = False
                raise

    # ----------------------------------------------------------------------------------------- acquiring

    async def try_acquire(
        self,
        wants: WantsLike,
        *,
        key: str | None = None,
        owner: str | None = None,
        ttl: Seconds | None = None,
        new_only: bool = False,
        request_id: str | None = None,
    ) -> Lease | None:
        """Take every wanted permit at once, or none: a ``Lease``, or ``None`` at once when there is no room.

        ``wants`` is a semaphore name (one permit), a ``{name: count}`` mapping, or a list of names,
        ``(name, count)`` pairs or ``Want``s. Retrying with the same ``key`` returns the same lease.
        With ``new_only``, a key that names a lease already, held or ended, is refused with ``KeyInUse`` instead of
        answered with that lease: two callers that chose the same key cannot both hold it (see docs/api.md).
        ``request_id`` names the request for that, the same across its retries (default: one made up per call).
        """
        owner_, key_, wants_, ttl_ms = self._request(wants, key, owner, ttl)
        # A key made up here names no other request: it only costs a lost reply its answer (docs/api.md).
        new_only = _validate.flag(new_only, "new_only") and key is not None
        made_up = request_id is None  # only then is every try of this request this call's own
        request_id = _request_id(new_only, request_id)
        # Held to a deadline of now, as acquire(timeout=0) is: over a link that hangs it gives up soon, not
        # after every retry's reply deadline (permits._deadline).
        with caller_deadline(monotonic()):
            if ttl is None and not self._settings.ttl_chosen:
                await self._store.open()  # a service's default TTL is known once it is open
                ttl_ms = self._default_ttl_ms()
            try:
                return await self._store.try_acquire(
                    owner_, key_, wants_, ttl_ms, new_only=new_only, request_id=request_id
                )
            except BaseException as exc:
                if not isinstance(exc, Exception | GeneratorExit):
                    # As acquire does: a grant that came as the call was interrupted is released.
                    with contextlib.suppress(Exception):
                        await async_shield(self._release_interrupted(owner_, key_, key is None, made_up, request_id))
                raise

    async def acquire(
        self,
        wants: WantsLike,
        *,
        key: str | None = None,
        owner: str | None = None,
        ttl: Seconds | None = None,
        timeout: Seconds | None = None,
        new_only: bool = False,
        request_id: str | None = None,
    ) -> Lease:
        """Take every wanted permit at once, waiting up to ``timeout`` seconds (``None``: for ever).

        Attempts back off exponentially with jitter, so waiters do not hammer the database; on PostgreSQL a
        waiter for one plain semaphore asks in the server's lock queue, which paces it; a waiter in a
        fair queue paces itself by its place, and waiters told of the same release spread their retries
        (see ``permits._pacing``). Every attempt uses the same key, so an attempt whose reply was lost can
        never grant twice. Raises ``AcquireTimeout`` when the time is up. An outage while it waits (the
        database or the service unavailable past the store's retries) is waited out too, within the timeout;
        if it still lasts then, that error is raised (``StorageUnavailable``, or ``ServiceUnavailable``).
        With ``new_only``, a key that names a lease already, held or ended, is refused with ``KeyInUse`` instead of
        answered with that lease: two callers that chose the same key cannot both hold it (see docs/api.md).
        """
        lease, _asked = await self._acquire(wants, key, owner, ttl, timeout, new_only, request_id)
        return lease

    async def _acquire(
        self,
        wants: WantsLike,
        key: str | None,
        owner: str | None,
        ttl: Seconds | None,
        timeout: Seconds | None,
        new_only: bool = False,
        request_id: str | None = None,
        ttl_at_most_ms: int | None = None,
        key_made_up: bool | None = None,
    ) -> tuple[Lease, float]:
        """``acquire``, and when the attempt that got the lease was sent (monotonic). ``ttl_at_most_ms``: a
        bound on the TTL, whichever default it comes from (``lease``'s ``max_hold``). ``key_made_up``: the key
        names no request of the caller's (default: none was given), so another may take its place."""
        key_made_up = key is None if key_made_up is None else key_made_up
        owner_, key_, wants_, ttl_ms = self._request(wants, key, owner, ttl)
        new_only = _validate.flag(new_only, "new_only") and key is not None
        made_up = request_id is None  # only then is every try of this request this call's own
        request_id = _request_id(new_only, request_id)
        limit = _validate.timeout(timeout, inf_is_none=True)
        deadline = None if limit is None else monotonic() + limit
        # Every operation for this call, the clean-up after it included, holds to its deadline: over a link
        # that hangs, the stores stop waiting for answers, and trying again, soon after it (permits._deadline).
        with caller_deadline(deadline):
            # What the store can do (queues_in_line), and a service's default TTL, are known once it is open.
            await self._store.open()
            if ttl is None:
                ttl_ms = self._default_ttl_ms()
            if ttl_at_most_ms is not None:
                ttl_ms = min(ttl_ms, ttl_at_most_ms)
            names = [w.name for w in wants_]
            contended = tuple(names)
            lost_races, quiet_until = self._contention.get(contended, (0, 0.0))
            pacer = WaitPacer(lost_races=lost_races, quiet_until=quiet_until)
            # Whether the next attempt waits for its turn in the server's lock queue (see _pacing).
            in_line = self._store.queues_in_line(wants_) and pacer.in_line_next()
            outage_since: float | None = None  # when the attempts began to find the database unavailable
            outages = 0  # attempts in a row that did
            rode_out = False  # an outage came while this call waited
            try:
                attempted = False
                while True:
                    wait = LONG_POLL_SECONDS if deadline is None else max(0.0, deadline - monotonic())
                    if attempted and wait == 0:
                        wait = LAST_ATTEMPT_SECONDS  # still an attempt that waited, as those before it
                    attempted = True
                    conflict: StorageConflict | None = None
                    # Read before the attempt: a call that arrives while the attempt runs then still counts.
                    calls = self._store.wake_calls(names)
                    asked = monotonic()
                    try:
                        lease = await self._store.try_acquire(
                            owner_,
                            key_,
                            wants_,
                            ttl_ms,
                            wait,
                            recheck=pacer.recheck_due(monotonic()),
                            in_line=in_line,
                            new_only=new_only,
                            request_id=request_id,
                        )
                    except StorageConflict as exc:
                        # Lock contention that outlasted the store's retries (a holder frozen inside its
                        # transaction, say) is one more way of having no room yet: keep waiting, within the timeout.
                        lease, conflict = None, exc
                        pacer.force_recheck()
                    except LeaseLost:
                        if not (rode_out and key_made_up):
                            raise
                        # An attempt before or during the outage was granted, its reply lost, and the lease ran
                        # out before the outage ended: the key names a lease that has ended. Under a key that
                        # names no request of the caller's, nothing of it is held and nobody saw it: ask anew,
                        # under a new key (one grant that ended, one live: never two at once).
                        logger.warning(
                            "a grant made as the outage began ran out during it: asking anew under a new key"
                        )
                        key_ = uuid.uuid4().hex
                        if made_up:
                            request_id = _request_id(new_only, None)
                        pacer.force_recheck()
                        continue
                    except UNAVAILABLE as exc:
                        if not self._rides_out_outages:
                            raise
                        rode_out = True
                        # An outage that outlasted the store's retries (a database restarting or failing over, a
                        # service instance being replaced) is ridden out as the holders ride it out: the caller
                        # asked to wait, and the database, once back, is where the room is. Every attempt carries
                        # the same key, so one whose grant committed unseen is answered with that lease, not a
                        # second one. The client opened before this loop, so its URL is right: a wrong one fails
                        # there, at once. At the deadline the outage is raised, not AcquireTimeout: the caller
                        # learns the database, not the semaphore, kept it waiting.
                        remaining = None if deadline is None else deadline - monotonic()
                        if remaining is not None and remaining <= 0:
                            raise
                        # A service's refusal after a send of this request got no answer (``refused``: the
                        # outcome is unknown, but the service answers) is asked again as an outage is, and is
                        # none: an interrupt meanwhile still releases by key.
                        if outage_since is None and not exc.details.get("refused"):
                            outage_since = monotonic()
                            logger.warning(
                                "waiting for %s through an outage: %s; asking again until %s",
                                _described(wants_),
                                exc.message,
                                "it answers" if limit is None else f"the timeout ({limit:g} s)",
                            )
                        pause = OUTAGE_BACKOFF.delay(outages)
                        outages += 1
                        await async_sleep(pause if remaining is None else min(pause, remaining))
                        in_line = False  # the server's lock queue is gone with the session that stood in it
                        # The last attempt may have been granted, its reply lost: only the full check finds that
                        # lease under the key (a quick one would see no room, its own grant holding it).
                        pacer.force_recheck()
                        continue
                    if outage_since is not None:
                        logger.info("reached the database again after %.1f s without it", monotonic() - outage_since)
                        outage_since, outages = None, 0
                    if lease is not None:
                        pacer.granted()
                        self._remember_contention(contended, pacer)
                        return lease, asked
                    pacer.refused(monotonic(), self._store.queue_short(owner_, key_))
                    self._remember_contention(contended, pacer)
                    # A request whose place in a fair queue will be called when its turn comes sleeps until then.
                    called = calls is not None and pacer.waits_turn() and self._store.place_called(owner_, key_)
                    delay, listen = (CALLED_MAX_SLEEP, True) if called else pacer.next_sleep(monotonic())
                    remaining = None if deadline is None else deadline - monotonic()
                    if remaining is not None:
                        if remaining <= 0:
                            # Stop waiting for good: give up the places in fair queues now rather than at expiry.
                            with contextlib.suppress(PermitsError):
                                await self._store.dequeue(owner_, key_)
                            described = _described(wants_)
                            # Where the last attempt never learnt whether there was room, say what held it up:
                            # "no room" alone would send its reader looking for holders that may not exist.
                            why = "" if conflict is None else f" (the last attempt was held up: {conflict.message})"
                            raise AcquireTimeout(
                                f"no room for {described} within {limit:g} s{why}",
                                key=key_,
                                owner=owner_,
                                timeout=limit,
                            ) from conflict
                        delay = min(delay, remaining)
                    # Where the server has a lock queue for it, ask again at once, in that queue (see _pacing).
                    in_line = self._store.queues_in_line(wants_) and pacer.in_line_next()
                    if in_line:
                        continue
                    if not listen:
                        await async_sleep(delay)
                    elif await self._store.wait_for_room(names, delay, calls if called else None):
                        spread = pacer.woken(called=called)
                        if deadline is not None:
                            spread = min(spread, max(0.0, deadline - monotonic()))
                        if spread > 0:
                            await async_sleep(spread)
                    in_line = self._store.queues_in_line(wants_) and pacer.in_line_next()
            except BaseException as exc:
                if not isinstance(exc, Exception) and outage_since is not None:
                    # Interrupted while the database does not answer: the clean-up below would spend the store's
                    # every retry on it (a minute, on a link that hangs: past a supervisor's grace), to give up
                    # places that lapse in seconds anyway. A grant the last attempt may have made runs out at
                    # its TTL instead, as the holder's own would. Said, and marked for lease(), which would
                    # otherwise release by key in the same way.
                    logger.warning(
                        "interrupted during an outage: a grant the last attempt may have made runs out at its TTL"
                    )
                    setattr(exc, INTERRUPTED_IN_OUTAGE, True)
                elif not isinstance(exc, Exception | GeneratorExit):
                    # (GeneratorExit: the task was dropped with its closed event loop, where nothing can be awaited.)
                    # Cancelled, or Ctrl-C, while waiting: give up the places in fair queues now, as a timeout
                    # does, not when they lapse (5 s, holding up every waiter behind them meanwhile), and release
                    # what the try under way may have got. Both under one shield: a second cancellation (a task
                    # group torn down after a timeout) must not stop the clean-up between the two.
                    with contextlib.suppress(Exception):
                        # (lease() releases its own key itself: not twice.)
                        await async_shield(self._give_up_interrupted(owner_, key_, key is None, made_up, request_id))
                elif isinstance(exc, ENDS_THE_REQUEST):
                    # A verdict on the request (another's lease under the key, the capacity lowered below its
                    # count, a semaphore deleted): it is over, and its places in fair queues with it, which would
                    # otherwise hold up the queue until they lapse. Not after an outage, which the give-up would
                    # only wait out again.
                    with contextlib.suppress(PermitsError):
                        await self._store.dequeue(owner_, key_)
                raise

    async def _give_up_interrupted(
        self, owner: str, key: str, key_made_up: bool, id_made_up: bool, request_id: str | None
    ) -> ReleaseOutcome | None:
        """An interrupted wait's places in fair queues given up, then ``_release_interrupted``."""
        with contextlib.suppress(Exception):
            await self._store.dequeue(owner, key)
        return await self._release_interrupted(owner, key, key_made_up, id_made_up, request_id)

    async def _release_interrupted(
        self, owner: str, key: str, key_made_up: bool, id_made_up: bool, request_id: str | None
    ) -> ReleaseOutcome | None:
        """After an acquire was interrupted (cancelled, Ctrl-C) with a try under way, which may have been
        granted: release what it got, rather than leave it held until its TTL, if it can be told apart.
        - Under a key made up for the call, which the caller never saw and so could never release: by key.
          (A key the caller gave may name a lease it holds already: that one is its to release.)
        - A request for a new lease only, under the caller's key, with a request id made up for the call:
          the lease that records that id; a lease under the key that another request got stays. Not with
          an id the caller gave: another try of the same request, elsewhere (a retry through another
          service instance), may have been answered with that lease, which is then its holder's."""
        if key_made_up:
            return await self._store.release(owner, key)
        if request_id is not None and id_made_up:
            return await self._store.release(owner, key, request_id=request_id)
        return None

    def _remember_contention(self, contended: tuple[str, ...], pacer: WaitPacer) -> None:
        """Keep how contended a set of semaphores is across acquires, so each new waiter does not learn it
        again by losing races (see ``permits._pacing``)."""
        if pacer.lost_races or pacer.quiet_until > monotonic():
            if len(self._contention) >= REMEMBERED_CONTENTION:
                self._contention.clear()
            self._contention[contended] = (pacer.lost_races, pacer.quiet_until)
        else:
            self._contention.pop(contended, None)

    def lease(
        self,
        wants: WantsLike,
        *,
        key: str | None = None,
        owner: str | None = None,
        ttl: Seconds | None = None,
        timeout: Seconds | None = None,
        keepalive: bool = False,
        max_hold: Seconds | None = None,
        on_lost: Callable[[str], Any] | None = None,
        new_only: bool = False,
    ) -> AsyncHeld:
        """``async with client.lease("backups") as lease:`` acquires (waiting up to ``timeout``) and
        releases on exit, also when the body raises. With ``keepalive``, a watchdog extends the lease
        while the block runs (see ``keepalive()``; ``max_hold`` and ``on_lost`` go to it), and the block's
        task is cancelled if the lease is lost (the block then raises ``LeaseLost``); ``held.lost`` tells a
        sync holder. ``new_only``: as in ``acquire``."""
        # Checked now; a TTL left to the default is the store's, known once the client is open (a service's).
        owner_, key_, wants_, _ = self._request(wants, key, owner, ttl)
        hold = _validate.max_hold(max_hold)
        # The lease must not outlive max_hold, and extends cannot shorten the grant's own TTL: so the grant
        # asks for no more than max_hold (at least the shortest TTL there is).
        ttl_at_most_ms = None if hold is None else max(1, math.ceil(min(hold, _validate.MAX_TTL_SECONDS) * 1000))
        keepalive = _validate.flag(keepalive, "keepalive")
        watch = _Watch(keepalive or hold is not None or on_lost is not None, hold, on_lost)
        return AsyncHeld(
            self,
            wants_,
            key_,
            owner_,
            ttl,
            _validate.timeout(timeout, inf_is_none=True),
            watch,
            fresh_keys=key is None,
            new_only=_validate.flag(new_only, "new_only") and key is not None,
            ttl_at_most_ms=ttl_at_most_ms,
        )

    def mutex(
        self,
        name: str,
        *,
        key: str | None = None,
        owner: str | None = None,
        ttl: Seconds | None = None,
        timeout: Seconds | None = None,
        keepalive: bool = False,
        max_hold: Seconds | None = None,
        on_lost: Callable[[str], Any] | None = None,
        new_only: bool = False,
    ) -> AsyncHeld:
        """A lease on one permit of ``name``: mutual exclusion when ``name`` has capacity 1 (see
        ``create_mutex``). Sugar over ``lease``: the same code path."""
        return self.lease(
            {name: 1},
            key=key,
            owner=owner,
            ttl=ttl,
            timeout=timeout,
            keepalive=keepalive,
            max_hold=max_hold,
            on_lost=on_lost,
            new_only=new_only,
        )

    def keepalive(
        self,
        lease: Lease,
        *,
        ttl: Seconds | None = None,
        max_hold: Seconds | None = None,
        on_lost: Callable[[str], Any] | None = None,
    ) -> AsyncWatchdog:
        """A watchdog that extends ``lease`` about every ttl/3 while the holder works:
        ``async with client.keepalive(lease) as dog:``. When the lease is lost, ``dog.lost`` is set,
        ``on_lost(reason)`` is called, and the task that entered the block is cancelled (the block then
        raises ``LeaseLost``). ``max_hold`` caps the total time it keeps the lease alive."""
        if self._closed:
            # Refused now: its first extend, a ttl/3 later in the background, would find the client closed
            # and report the lease lost while it is still held.
            raise UsageError("this client is closed: keepalive needs an open client to extend the lease")
        if not isinstance(lease, Lease):
            raise _validate.InvalidArgument("keepalive takes the Lease that acquire returned", field="lease")
        ttl_ = None if ttl is None else _validate.ttl_ms(ttl) / 1000
        hold = _validate.max_hold(max_hold)
        return AsyncWatchdog(self, lease, ttl=ttl_, max_hold=hold, on_lost=on_lost)

    async def release(
        self,
        lease: Lease | str,
        *,
        owner: str | None = None,
        request_id: str | None = None,
        timeout: Seconds | None = None,
    ) -> ReleaseOutcome:
        """Give a lease's permits back. Idempotent: ``RELEASED``, ``ALREADY_RELEASED``, ``LOST`` (it had
        ended by expiry or revocation before this call) or ``NOT_FOUND``. With ``request_id`` (the one an
        acquire with ``new_only`` was given), only the lease that request got: a lease under the key that
        records another request's id, or none, is left alone, and the answer is ``NOT_FOUND``. For a caller
        that gave up on such an acquire without learning whether it was granted.

        With ``timeout``, it gives up soon after that many seconds over a link that hangs, as ``ping`` does,
        raising ``StorageUnavailable`` (through a service, soon after it and the service's ``answer_grace``):
        the release may or may not have been made, and calling again is safe. Unreleased, the lease ends at
        its expiry. (A ``lease()`` block's exit bounds its release so, by the time the lease has left.)"""
        owner_, key_ = self._lease_ref(lease, owner)
        own = None if request_id is None else _validate.request_id(request_id)
        deadline = _deadline_after(timeout)
        # A Lease says which semaphores it holds; a key alone does not.
        one_semaphore = isinstance(lease, Lease) and len(lease.counts) == 1
        if deadline is None:  # the common call, on the path of every cycle: no deadline of its own to set
            return await self._release(owner_, key_, one_semaphore, own)
        with caller_deadline(deadline):
            return await self._release(owner_, key_, one_semaphore, own)

    async def _release(self, owner: str, key: str, one_semaphore: bool, request_id: str | None) -> ReleaseOutcome:
        if request_id is None:  # as before request ids: a store of another package's may not know them
            return await self._store.release(owner, key, one_semaphore)
        return await self._store.release(owner, key, one_semaphore, request_id=request_id)

    async def extend(
        self,
        lease: Lease | str,
        ttl: Seconds | None = None,
        *,
        owner: str | None = None,
        timeout: Seconds | None = None,
    ) -> Lease:
        """Set a held lease to expire ``ttl`` seconds from now, on the database's clock. Without ``ttl``,
        by the lease's own TTL (``lease.ttl``), the one it was acquired with, whichever client asks. A ``ttl``
        given changes the expiry, not the lease's TTL. (A lease granted before the database's schema kept
        TTLs, revision 0008, has none: this client's ttl, then.)

        Raises ``LeaseLost`` if it was released or has expired (its permits may be someone else's now),
        ``LeaseNotFound`` if it never existed.

        With ``timeout``, it gives up soon after that many seconds over a link that hangs, as ``ping`` does,
        raising ``StorageUnavailable`` (through a service, soon after it and the service's ``answer_grace``);
        whether the lease was extended is then unknown. (The watchdog gives each of its extends the time the
        lease has left.)"""
        owner_, key_ = self._lease_ref(lease, owner)
        ttl_ms = None if ttl is None else _validate.ttl_ms(ttl)
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.extend(owner_, key_, ttl_ms)

    async def revoke(
        self, lease: Lease | str, *, owner: str | None = None, reason: str, timeout: Seconds | None = None
    ) -> Lease:
        """End someone's lease now, as an administrator, recording ``reason``; its permits come back at
        once. The holder finds out at its next extend (``LeaseLost`` with reason ``revoked``). Returns the
        lease as it is afterwards; one that had ended already is returned unchanged.

        With ``timeout``, it gives up soon after that many seconds over a link that hangs, as ``release``
        does, raising ``StorageUnavailable``; whether the lease was revoked is then unknown, and asking again
        is safe."""
        owner_, key_ = self._lease_ref(lease, owner)
        note = _validate.reason(reason, required=True)
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.revoke(owner_, key_, note)

    async def get_lease(self, key: str, *, owner: str | None = None, timeout: Seconds | None = None) -> Lease:
        """The lease under ``key``, held or ended. Raises ``LeaseNotFound``."""
        owner_, key_ = self._lease_ref(key, owner)
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.get_lease(owner_, key_)

    async def holders(self, name: str, *, timeout: Seconds | None = None) -> list[Holder]:
        """The leases holding permits of ``name`` now, in token order (expired ones not yet reclaimed show a
        negative ``expires_in``)."""
        name = _validate.name(name)
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.holders(name)

    # ---------------------------------------------------------------------------------------- semaphores

    async def create_semaphore(
        self,
        name: str,
        capacity: int,
        *,
        exist_ok: bool = False,
        who: str | None = None,
        fair: bool = False,
        timeout: Seconds | None = None,
    ) -> Semaphore:
        """Create a semaphore of ``capacity`` permits. With ``exist_ok``, an existing semaphore of the same
        capacity (and mode) is returned instead of raising ``SemaphoreExists``. ``who`` (default: this
        client's owner) is recorded as the creator in the capacity history.

        ``fair``: waiting acquires are granted in arrival order, a large request included; one that waits
        keeps its place only while it keeps asking (see docs/primitives.md)."""
        by = self.owner if who is None else _validate.who(who)
        name, capacity = _validate.name(name), _validate.capacity(capacity)
        exist_ok, fair = _validate.flag(exist_ok, "exist_ok"), _validate.flag(fair, "fair")
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.create_semaphore(name, capacity, by, exist_ok, fair)

    async def create_rwlock(self, name: str, *, exist_ok: bool = False, timeout: Seconds | None = None) -> Semaphore:
        """Create a read-write lock: a fair semaphore of ``RWLOCK_READERS`` permits. Hold it with
        ``permits.shared(name)`` (one permit: many readers at once) or ``permits.exclusive(name)`` (all of
        them: one writer, no reader). Fair mode keeps writers from starving: once a writer waits, readers
        that come after it wait behind it."""
        return await self.create_semaphore(name, RWLOCK_READERS, exist_ok=exist_ok, fair=True, timeout=timeout)

    async def waiters(self, name: str, *, timeout: Seconds | None = None) -> list[Waiter]:
        """The requests waiting for room on the fair semaphore ``name``, in queue order."""
        name = _validate.name(name)
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.waiters(name)

    async def create_mutex(self, name: str, *, exist_ok: bool = False, timeout: Seconds | None = None) -> Semaphore:
        """Create a semaphore of capacity 1."""
        return await self.create_semaphore(name, 1, exist_ok=exist_ok, timeout=timeout)

    async def get_semaphore(self, name: str, *, timeout: Seconds | None = None) -> Semaphore:
        """Capacity, use and last token of ``name``. Raises ``SemaphoreNotFound``."""
        name = _validate.name(name)
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.get_semaphore(name)

    async def list_semaphores(self, prefix: str = "", *, timeout: Seconds | None = None) -> list[Semaphore]:
        """Every semaphore whose name starts with ``prefix``, by name."""
        if not isinstance(prefix, str):
            raise _validate.InvalidArgument("a prefix must be a string", field="prefix")
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.list_semaphores(prefix)

    async def set_capacity(
        self, name: str, capacity: int, *, reason: str, who: str | None = None, timeout: Seconds | None = None
    ) -> CapacityChange:
        """Change a capacity, recording who, why and when. Lowering it below the permits in use revokes
        nothing: no new grant until use drops below the new capacity."""
        by = self.owner if who is None else _validate.who(who)
        args = (_validate.name(name), _validate.capacity(capacity), by, _validate.reason(reason, required=True))
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.set_capacity(*args)

    async def capacity_history(
        self, name: str, *, limit: int = 100, timeout: Seconds | None = None
    ) -> list[CapacityChange]:
        """The capacity changes of ``name``, newest first (creation included)."""
        args = (_validate.name(name), _validate.batch_size(limit, "limit"))
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.capacity_history(*args)

    async def delete_semaphore(self, name: str, *, force: bool = False, timeout: Seconds | None = None) -> int:
        """Delete a semaphore. Refused with ``SemaphoreInUse`` while leases hold its permits, unless
        ``force``, which revokes those leases (whole leases: a lease is all or nothing). Returns the number
        of leases revoked. Its fencing tokens are kept: a semaphore created again under the same name
        carries on above them. With ``timeout``, one that gives up over a link that hangs raises
        ``StorageUnavailable`` with the delete made or not: asked again, it may find the semaphore gone
        (``SemaphoreNotFound``)."""
        args = (_validate.name(name), _validate.flag(force, "force"))
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.delete_semaphore(*args)

    # --------------------------------------------------------------------------------------- maintenance

    async def sweep(
        self, *, batch_size: int = 500, max_batches: int | None = None, timeout: Seconds | None = None
    ) -> SweepResult:
        """End every expired lease, in short transactions of ``batch_size`` leases.

        With ``timeout``, no batch starts after that many seconds (the first always runs), and the result
        says whether the sweep was ``complete``, as it does when ``max_batches`` ends it; over a link that
        hangs, it gives up soon after the timeout, as ``release`` does, raising ``StorageUnavailable``
        (the batches before it stay done; sweeping again is safe)."""
        if max_batches is not None:
            _validate.batch_size(max_batches, "max_batches")
        batch_size = _validate.batch_size(batch_size)
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.sweep(batch_size, max_batches)

    async def reconcile(self, *, repair: bool = False, timeout: Seconds | None = None) -> list[Drift]:
        """Compare each semaphore's count of permits in use with its held permit rows, and report drift.
        With ``repair``, recount each drifted semaphore under its row lock and store the true count.

        With ``timeout``, no repair starts after that many seconds: the drift left is returned as found
        (``repaired`` false); over a link that hangs, it gives up soon after the timeout, raising
        ``StorageUnavailable`` (the repairs before it stay done; asking again is safe)."""
        repair = _validate.flag(repair, "repair")
        with caller_deadline(_deadline_after(timeout)):
            return await self._store.reconcile(repair)

    async def ping(self, *, timeout: Seconds | None = None) -> None:
        """One cheap round trip to the database (or the service); raises ``StorageUnavailable``
        (``ServiceUnavailable``) if it cannot be reached. For health checks.

        With ``timeout``, it gives up soon after that many seconds, as ``acquire(timeout=...)`` does over a
        link that hangs (docs/deployment.md, "A link that hangs"): an attempt waits for its answer at least
        the store's least reply time (15 s with the default lock wait; through a service, the service's
        ``answer_grace``, 25 s), not minutes of retries. ``None``: the store's own reply deadline and
        retries alone."""
        if self._closed:
            raise UsageError("this client is closed")
        with caller_deadline(_deadline_after(timeout)):
            await self._store.ping()

    async def upgrade_schema(self) -> str:
        """Create or upgrade the schema (``permits db upgrade``); returns the revision."""
        return await self._store.upgrade_schema()

    async def drop_old_functions(self, *, dry_run: bool = False) -> list[str]:
        """Drop the server functions that other versions of permits made on PostgreSQL (``permits db
        drop-old-functions``), and return them; with ``dry_run``, only list them. Run it once no client of
        another version runs: such a client would go on without them, slower (docs/deployment.md, "Server
        functions")."""
        return await self._store.drop_old_functions(_validate.flag(dry_run, "dry_run"))

    # ------------------------------------------------------------------------------------------- helpers

    def _request(
        self, wants: WantsLike, key: str | None, owner: str | None, ttl: Seconds | None
    ) -> tuple[str, str, tuple[Want, ...], int]:
        if self._closed:
            raise UsageError("this client is closed")
        wants_ = _validate.wants(wants)
        # A generated key still makes the store's own retries safe (kazoo prefixes its lock nodes with a
        # uuid for the same reason); a caller that retries across processes passes its own.
        key_ = uuid.uuid4().hex if key is None else _validate.key(key)
        owner_ = self.owner if owner is None else _validate.owner(owner)
        ttl_ms = self._default_ttl_ms() if ttl is None else _validate.ttl_ms(ttl)
        return owner_, key_, wants_, ttl_ms

    def _lease_ref(self, lease: Lease | str, owner: str | None) -> tuple[str, str]:
        if self._closed:
            raise UsageError("this client is closed")
        if isinstance(lease, Lease):
            return (lease.owner if owner is None else _validate.owner(owner)), lease.key
        return (self.owner if owner is None else _validate.owner(owner)), _validate.key(lease)


def _described(wants: tuple[Want, ...]) -> str:
    """``backups:1, db:2``: wants as messages and reprs name them."""
    return ", ".join(f"{w.name}:{w.count}" for w in wants)


def _deadline_after(timeout: Seconds | None) -> float | None:
    """When a call given ``timeout`` ends (``monotonic()`` time), or ``None`` for no deadline of its own
    (``None``, or ``math.inf``); a bad timeout is an ``InvalidArgument``, before anything is asked."""
    if timeout is None:
        return None
    limit = _validate.timeout(timeout, inf_is_none=True)
    return None if limit is None else monotonic() + limit


def _request_id(new_only: bool, given: str | None) -> str | None:
    """The id a request for a new lease only is known by in each of its tries (``flows.Request.request_id``):
    the caller's (a service relays its client's), else one made up for this call. Other requests need none."""
    if given is not None:
        checked = _validate.request_id(given)
        return checked if new_only else None
    return uuid.uuid4().hex if new_only else None


@dataclass(frozen=True, slots=True)
class _Watch:
    """Whether and how a held lease is kept alive."""

    on: bool = False
    max_hold: float | None = None
    on_lost: Callable[[str], Any] | None = None


class AsyncHeld:
    """The context manager behind ``AsyncClient.lease`` and ``AsyncClient.mutex``."""

    def __init__(
        self,
        client: AsyncClient,
        wants: tuple[Want, ...],
        key: str,
        owner: str,
        ttl: Seconds | None,
        timeout: float | None,
        watch: _Watch | None = None,
        fresh_keys: bool = False,
        new_only: bool = False,
        ttl_at_most_ms: int | None = None,
    ) -> None:
        self._client = client
        self._new_only = new_only
        self._ttl_at_most_ms = ttl_at_most_ms
        self._wants = wants
        self._key = key
        #: the key was made up, not given: each entry after the first makes a new one, since a key names one
        #: request, and a second entry under the first one's key would get that (released) lease back
        self._fresh_keys = fresh_keys
        self._entries = 0
        #: held from entry to exit: a lease() is one holder's at a time
        self._in_use = async_lock()
        self._owner = owner
        self._ttl = ttl
        self._timeout = timeout
        self._watch = watch or _Watch()
        self.lease: Lease | None = None
        #: the watchdog while the block runs, when keepalive is on
        self.watchdog: AsyncWatchdog | None = None
        #: when the lease runs out without extends (``monotonic()``), reckoned from the request that got it
        self._deadline = 0.0

    def __repr__(self) -> str:
        wanted = _described(self._wants)
        state = "lost" if self.lost else "held" if self.lease is not None and self._in_use.locked() else "not held"
        return f"<{type(self).__name__} {wanted} key={self._key!r} owner={self._owner!r} {state}>"

    @property
    def lost(self) -> bool:
        """True once the watchdog found the lease lost (see ``watchdog.reason``)."""
        return self.watchdog is not None and self.watchdog.lost.is_set()

    async def __aenter__(self) -> Lease:
        if not await async_try_lock(self._in_use):
            # Shared between threads or tasks, or entered again inside its own block, one object would hand
            # every holder the same lease (the same key is the same request): all of them inside at once.
            raise UsageError(
                "this lease() or mutex() is held already: it is one holder's at a time; make one per"
                " thread or task (and per nesting level) that holds it"
            )
        try:
            if self._entries and self._fresh_keys:
                self._key = uuid.uuid4().hex
            self._entries += 1
            self.lease, self.watchdog = None, None
            self.lease, asked = await self._client._acquire(
                self._wants,
                self._key,
                self._owner,
                self._ttl,
                self._timeout,
                self._new_only,
                ttl_at_most_ms=self._ttl_at_most_ms,
                key_made_up=self._fresh_keys,
            )
            self._key = self.lease.key  # a made-up key may have been made anew (see _acquire)
            self._deadline = asked + self.lease.expires_in  # reckoned from the request: never later than the lease's
            if self._watch.on:
                self.watchdog = AsyncWatchdog(
                    self._client,
                    self.lease,
                    max_hold=self._watch.max_hold,
                    on_lost=self._watch.on_lost,
                    counted_from=asked,
                )
                await self.watchdog.start()
            return self.lease
        except BaseException as exc:
            try:
                if self.lease is not None:
                    # Granted, but its watchdog could not start: the block does not run, so nothing holds it.
                    # (``lease`` is then None again: no lease is held, and nothing may release it twice.)
                    granted, self.lease = self.lease, None
                    with contextlib.suppress(Exception):
                        await async_shield(self._client.release(granted, owner=self._owner))
                elif (
                    not isinstance(exc, Exception | GeneratorExit)  # (closed with its dropped loop: nothing to await)
                    and not self._new_only
                    and not hasattr(exc, INTERRUPTED_IN_OUTAGE)
                ):
                    # Interrupted (cancelled, Ctrl-C) while the grant may have committed: release by key so
                    # the permits do not wait for the TTL. Releasing a key never granted changes nothing. Not
                    # for a request for a new lease only: the lease under its key may be another caller's (the
                    # acquire itself released the one its request got, known by its request id).
                    with contextlib.suppress(Exception):
                        await async_shield(self._client.release(self._key, owner=self._owner))
            finally:
                # Only now: entered meanwhile under a key of the caller's, another holder would get this
                # attempt's lease back, and then lose it to the release above.
                self._in_use.release()
            raise

    async def __aexit__(self, *exc_info: Any) -> None:
        ended_at = monotonic()
        if self.watchdog is not None:
            # Now, not in the shielded task below, which starts a turn of the loop later: a loss found in
            # that turn would cancel this exit, not the block's work.
            self.watchdog.stopping()
        try:
            # Shielded whole: a cancellation that comes now (a task group torn down) must not stop the
            # watchdog's stop short of the release, and leave the permits held until their TTL.
            outcome = await async_shield(self._stop_and_release())
        except BaseException as exc:
            if self.watchdog is not None:
                self.watchdog.lost_in_place_of(exc)  # its own cancellation taken back; this one stays
            raise
        if self.watchdog is not None:
            # A loss that cancelled the block is raised as LeaseLost (see AsyncWatchdog.lost_in_place_of).
            lost = self.watchdog.lost_in_place_of(exc_info[1])
            if lost is not None:
                raise lost from exc_info[1]
        if outcome is ReleaseOutcome.LOST and exc_info[0] is None and not self.lost:
            # The block ran to its end, but the lease had ended before it did (it expired, say, with no
            # watchdog to extend it), and nobody said so: part of the block's work ran unprotected, maybe
            # beside another holder. Said now, as redis-py's LockNotOwnedError says it, rather than left for
            # the caller to find. (A loss the watchdog found was told already: on_lost, lost, a cancel.)
            lost = await self._lost_before(ended_at)
            if lost is not None:
                raise lost

    async def _stop_and_release(self) -> ReleaseOutcome:
        try:
            if self.watchdog is not None:
                await self.watchdog.stop()
            # The lease itself rather than its key: it says which semaphores it holds (see release).
            held: Lease | str = self._key if self.lease is None else self.lease
            # Bounded by the lease's own deadline: past it the permits come back at its expiry anyway, and over
            # a link that hangs the store's own bounds would hold the block's exit for minutes (the store still
            # waits one reply, and a lock wait and 5 s past the deadline, before giving up: permits._deadline).
            deadline = max(self._deadline, self.watchdog.deadline if self.watchdog is not None else 0.0)
            return await self._client.release(held, owner=self._owner, timeout=max(0.0, deadline - monotonic()))
        finally:
            self._in_use.release()

    async def _lost_before(self, ended_at: float) -> LeaseLost | None:
        """The error for a lease found ended at the release of a block that ended at ``ended_at``
        (``monotonic()``), unless it may have run out only after that: its TTL, reckoned from the request
        that got it (or the watchdog's last extend), had not passed then. A release held up past the TTL
        (a database slow to answer) does not make the block's work unprotected."""
        reason = self.watchdog.reason if self.watchdog is not None and self.watchdog.reason else None
        if reason is None:
            with contextlib.suppress(PermitsError):
                ended = await self._client.get_lease(self._key, owner=self._owner)
                reason = None if ended.end_reason is None else str(ended.end_reason)
        reason = reason or "expired"
        # The grant's own, or a later one an extend gave (an extend held up past the TTL may give an earlier).
        deadline = max(self._deadline, self.watchdog.deadline if self.watchdog is not None else 0.0)
        if reason in ("expired", "swept") and ended_at < deadline:
            return None
        return LeaseLost(
            f"lease {self._key!r} ended ({reason}) before its block did: the block's work was not all done under it",
            key=self._key,
            owner=self._owner,
            reason=reason,
        )
