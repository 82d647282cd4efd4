"""The HTTP store: the same operations as the SQL store, carried out by a permits service over JSON.

``permits.connect("http://host:8080")`` picks it, so application code does not change when it moves from
the embedded library to the service. Errors come back as ``{"error": {"code", "message", "details"}}``
and are raised as the class registered for ``code``: ``except permits.LeaseLost`` works the same either
way.

Retries: a dropped connection, a proxy's 502, 503 or 504, the service's 503 and a conflict it could not
absorb are retried with backoff and jitter (honouring Retry-After), each time with the same request, so
an acquire keeps its key and never grants twice. An acquire's resend asks only for what is left of its
wait, and while it has wait left it keeps trying a service it cannot connect to (an instance restarting).
A request that is not idempotent is sent again only after an answer that says it was not carried out.
"""

from __future__ import annotations

import functools
import logging
import math
import ssl
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

import httpx

from permits import _wire
from permits._backoff import RETRY_BACKOFF
from permits._config import DEFAULT_TTL, Settings
from permits._deadline import CALLER_DEADLINE, caller_deadline, past_giving_up, reply_within
from permits._exceptions import (
    AcquireTimeout,
    ConfigurationError,
    InvalidArgument,
    LimitExceeded,
    PermitsError,
    ServiceError,
    ServiceUnavailable,
    StorageConflict,
    StorageUnavailable,
    UsageError,
    error_class,
)
from permits._io import async_loop, async_sleep, forks, keep_inherited, monotonic, shut_down
from permits._models import (
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

logger = logging.getLogger("permits.http")
#: How long to wait for the service beyond the time a request may legitimately wait for room.
RESPONSE_MARGIN = 30.0
#: A sweep through a service for a caller with no timeout goes in parts of this many seconds each (the
#: service starts no batch after it), each answered well within a reply's wait, until it is complete.
SWEEP_PART_SECONDS = 20.0
#: The longest Retry-After this client honours; the service asks for seconds, not minutes.
MAX_RETRY_AFTER = 5.0
#: Transport failures that come before a request is sent: no connection was made, or none was free.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
#: The service's refusals that say the request was not carried out: sent again even if not idempotent. (A
#: conflict is one the service rolled back; ``storage_unavailable`` may come after a commit.)
NOT_CARRIED_OUT = (ServiceUnavailable, LimitExceeded, StorageConflict)
#: What a proxy in front of the service answers when it could not reach an instance, or got no answer from
#: one in time: like a dropped connection, the request may or may not have reached the service.
PROXY_FAILURES = frozenset({502, 503, 504})
#: What a healthy service may take beyond a request's wait, by default: its pre-lock wait (10 s), then its
#: store's least wait for a database's answer (15 s, ``permits._deadline``). A service says its own
#: (``answer_grace`` in ``GET /v1/whoami``); this is for one that does not. A caller's point of giving up is
#: this long after its deadline, and a send waits at least this long for its answer however late it is
#: sent: less would cut a healthy service's answer, and leave a grant it made unseen until its TTL.
SERVICE_GRACE_SECONDS = 25.0
#: The longest pause between connection attempts of an acquire that still has wait left.
MAX_RECONNECT_PAUSE = 1.0
#: At most this many requests known to hold no place are remembered (a grant or a give-up forgets one).
MAX_PLACELESS = 10_000


#: httpcore's trace events that hand over a new connection's stream (``return_value``), TLS's included.
NEW_STREAM_EVENTS = ("connect_tcp.complete", "connect_unix_socket.complete", "start_tls.complete")


def _with_time_left(body: dict[str, Any], deadline: float | None) -> dict[str, Any]:
    """``body`` with the ``timeout`` left before ``deadline`` (``monotonic()`` time), if there is one."""
    return body if deadline is None else {**body, "timeout": max(0.0, deadline - monotonic())}


def path_part(value: str) -> str:
    """A name or key as one path segment: every reserved character percent-encoded, dots too, so that no
    client or proxy folds ``.`` or ``..`` segments."""
    return quote(value, safe="").replace(".", "%2E")


def _certificate_refused(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The TLS verification failure behind a transport error (httpx wraps httpcore's, which wraps ssl's)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class _Requests:
    """An httpx client of the store's, and the operations under way in it (each a request and its resends).

    ``close()`` ends it as a client of a database ends: new operations are refused with ``UsageError`` at
    once, those under way may still send again, and the httpx client is closed when the last one is done.
    httpx's own close would instead cut an asyncio request short (a release whose outcome nobody learns)
    and leave a thread's blocked on a socket closed under it. With ``cut_at_close``, the requests under way
    are ended then instead, and any connection made after: its socket is shut down, so that a read blocked
    on it in another thread returns at once. The store's long polls (acquires that wait for room) end that
    way, and the service, which watches for a client that goes away (``server/gone.py``), stops waiting."""

    def __init__(self, base: str, headers: dict[str, str], verify: ssl.SSLContext, cut_at_close: bool) -> None:
        timeout = httpx.Timeout(RESPONSE_MARGIN, connect=5.0)
        self.http = httpx.AsyncClient(base_url=base, headers=headers, timeout=timeout, verify=verify)
        self._guard = threading.Lock()  # operations come from any thread (a sync client) or task
        self._under_way = 0
        self._cut_at_close = cut_at_close
        self._closing = self._closed = False
        #: every connection's stream, found by httpcore's trace: the sockets that a cut shuts down
        self._streams: weakref.WeakSet[Any] = weakref.WeakSet()

    def admit(self) -> None:
        """One more operation under way, until its ``done()``; refused once the client is closing."""
        with self._guard:
            if self._closing:
                raise UsageError("this client is closed")
            self._under_way += 1

    async def done(self) -> None:
        if self._one_less():
            await self._close_now()

    def _one_less(self) -> bool:
        """An operation is done: whether it was the last one under way of a client being closed."""
        with self._guard:
            self._under_way -= 1
            return self._closing and self._under_way == 0

    async def send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One send of an admitted operation."""
        if self._cut_at_close:  # httpcore calls the trace some ten times a request: only where a cut needs it
            kwargs["extensions"] = {"trace": self._trace}
        return await self.http.request(method, path, **kwargs)

    async def _trace(self, event: str, info: dict[str, Any]) -> None:
        if event.endswith(NEW_STREAM_EVENTS) and info.get("return_value") is not None:
            stream = info["return_value"]
            with self._guard:
                self._streams.add(stream)
                cut = self._closing  # a connection made once the cut came: cut it too
            if cut:
                _shut_down(stream)

    async def close(self) -> None:
        with self._guard:
            self._closing = True
            idle = self._under_way == 0
            streams = list(self._streams) if self._cut_at_close else []
        for stream in streams:
            _shut_down(stream)
        if idle:
            await self._close_now()

    async def _close_now(self) -> None:
        with self._guard:
            if self._closed:
                return
            self._closed = True
        try:
            await self.http.aclose()
        except Exception:  # run in an operation's ``finally``: a failure to close must not replace its outcome
            logger.debug("closing the service's connections failed", exc_info=True)


def _shut_down(stream: Any) -> None:
    """End a connection as a network failure would: a read blocked on its socket, in any thread, returns.
    Through a copy of its file descriptor (``_io.shut_down``): a TLS socket's own ``shutdown()`` would also
    drop its TLS state, under a thread that may be using it."""
    sock = stream.get_extra_info("socket")
    if sock is not None:
        fd = sock.fileno()
        if fd >= 0:  # -1: closed already
            shut_down(fd)


class AsyncHTTPStore:
    """Carries out operations through a permits service (``permits serve``).

    Two httpx clients: one for the long polls (requests that wait for room), one for the rest, so that
    ``close()`` can end the long polls at once and let the rest finish (``_Requests``)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        base = settings.url.render_as_string(hide_password=False).rstrip("/")
        headers = {"User-Agent": "permits-python"}
        if settings.token is not None:
            headers["Authorization"] = f"Bearer {settings.token}"
        # One TLS context for both httpx clients (each would load the CA bundle again), and for a forked
        # child's: a plain http:// URL never uses it.
        self._http_args = (base, headers, httpx.create_ssl_context())
        self._requests, self._long_polls = self._new_pools()
        self._fork_guard = threading.Lock()
        self._forks = forks()
        #: the event loop the pools' connections were made in (asyncio; see ``_renew_if_other_loop``)
        self._loop: Any = None
        self._opened = False
        self._closed = False
        self._max_wait = 0.0
        #: whether the service keeps a timed-out request's place in a fair queue when asked (``keep_place``)
        self._keeps_places = False
        #: what the service supports beyond the first API (``routes.FEATURES``), as it said when opened
        self._features: frozenset[str] = frozenset()
        #: what a healthy service may take past a request's wait (``SERVICE_GRACE_SECONDS``): as it says
        self._grace = SERVICE_GRACE_SECONDS
        self._default_ttl_ms: int | None = None
        #: whether this client ever asked to keep places: those may outlive an older instance's refusal
        self._kept_places = False
        #: (owner, key) of requests whose last 409 said that the service kept no place for them (a plain
        #: semaphore's, say): their give-up would find nothing, so it is not sent
        self._placeless: set[tuple[str, str]] = set()
        #: Acquires (owner, key) a send of which may have reached the service and got no answer: a refusal
        #: that says "not carried out" for a later send, in this call or a later one (the client's ride-out
        #: loop makes a new call), is raised as an unknown outcome. Forgotten at an answer for the key.
        self._unanswered: set[tuple[str, str]] = set()

    def _new_pools(self) -> tuple[_Requests, _Requests]:
        """The connection pools: for plain requests, and for long polls (which close() cuts short)."""
        return _Requests(*self._http_args, cut_at_close=False), _Requests(*self._http_args, cut_at_close=True)

    def _renew_if_forked(self) -> None:
        """In a forked child: a connection pool of its own (see ``_io.forks``). The parent's is kept
        unclosed: closing would end the parent's connections."""
        if self._forks != forks():
            with self._fork_guard:  # against another thread renewing, or closing, at the same time
                if self._forks != forks():
                    keep_inherited((self._requests, self._long_polls))
                    self._requests, self._long_polls = self._new_pools()
                    self._forks = forks()  # last: a close() that sees it closes the new pools

    def _renew_if_other_loop(self) -> None:
        """Pools of their own in another event loop (a second ``asyncio.run`` with a client made at import
        time): httpx's pooled connections belong to the loop they were made in, and fail in another with
        'Event loop is closed'. The old loop's are let go, not closed: that needs the old loop."""
        loop = async_loop()
        if loop is self._loop:
            return
        with self._fork_guard:
            if self._loop is not None and loop is not self._loop:
                self._requests, self._long_polls = self._new_pools()
            self._loop = loop

    @property
    def url(self) -> str:
        return self._settings.shown_url

    @property
    def default_ttl_ms(self) -> int | None:
        return self._default_ttl_ms

    async def open(self) -> None:
        """Check that the service answers and knows our token."""
        if self._closed:
            raise UsageError("this client is closed")
        if not self._opened:
            about = await self._call("GET", "/v1/whoami")
            # A wait is a long poll on the service, which bounds it: ask for no more than it allows.
            limits = about.get("limits", {})
            self._max_wait = float(limits.get("max_wait", self._max_wait))
            # A lease without a TTL of its caller's gets the service's default, within its max_ttl (an older
            # service, which does not say its default, has the library's, and then refused it above max_ttl).
            default_ttl = limits.get("default_ttl", min(DEFAULT_TTL, float(limits.get("max_ttl", DEFAULT_TTL))))
            self._default_ttl_ms = max(1, math.floor(float(default_ttl) * 1000))  # never past max_ttl
            self._features = frozenset(about.get("features", ()))
            self._keeps_places = "keep_place" in self._features
            # How long past a wait it may take to answer while healthy (an older service does not say).
            self._grace = float(limits.get("answer_grace", SERVICE_GRACE_SECONDS))
            self._opened = True

    async def close(self) -> None:
        """Refuse new requests; let those under way finish, except the long polls, which end now: a waiting
        acquire gets ``UsageError``. (In a forked child, the pools are the parent's, as in ``_renew_if_forked``.)"""
        self._closed = True
        with self._fork_guard:
            if self._forks != forks():
                return
            pools = (self._long_polls, self._requests)
        for pool in pools:
            await pool.close()

    # ------------------------------------------------------------------------------------------ operations

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
        # ``recheck`` and ``in_line`` do not cross HTTP: the service runs its own waiting loop (a long poll).
        await self.open()
        if new_only and "new_only" not in self._features:
            raise UsageError(f"the permits service at {self.url} is too old for new_only: upgrade it")
        wait = min(wait, self._max_wait)
        body = {
            "wants": [{"name": w.name, "count": w.count} for w in wants],
            "key": key,
            "owner": owner,
            "ttl": ttl_ms / 1000,
            "wait": wait,
        }
        # A service that keeps request ids knows this request's lease from another's, so a try whose reply
        # was lost can be sent again (an older one cannot tell: see the call below).
        resendable = not new_only or (request_id is not None and "request_id" in self._features)
        if new_only:
            body["new_only"] = True
            if resendable:
                body["request_id"] = request_id
        if wait > 0 and self._keeps_places:
            # The client asks again with this key until its own timeout, and then gives its places up
            # (``dequeue``): a wait longer than the service's max_wait keeps its place in a fair queue.
            body["keep_place"] = self._kept_places = True
        deadline = monotonic() + wait
        sends = 0  # of the call under way

        def asked_now() -> dict[str, Any]:
            nonlocal sends
            sends += 1
            # A resend (after a dropped connection, a 503) waits only for what is left of the wait.
            return {**body, "wait": round(max(0.0, deadline - monotonic()), 3) if wait > 0 else 0.0}

        while True:
            sends = 0
            try:
                # A request for a new lease only without a request id is not sent again once it may have
                # been granted: its own lease, granted with the reply lost, would come back as another's.
                data = await self._call(
                    "POST",
                    "/v1/leases",
                    body=asked_now,
                    deadline=deadline,
                    idempotent=resendable,
                    conflicts_final=wait == 0,
                    unanswered=(owner, key),
                )
            except AcquireTimeout as exc:
                self._unanswered.discard((owner, key))  # asked with its key: the lease under it is not there
                if body.get("keep_place"):
                    # A service that does not say (an older version) may have kept one: give it up.
                    if exc.details.get("kept_place") is False:
                        if len(self._placeless) >= MAX_PLACELESS:
                            self._placeless.clear()  # at worst, a give-up that finds nothing
                        self._placeless.add((owner, key))
                    else:
                        self._placeless.discard((owner, key))
                return None
            except InvalidArgument as exc:
                # An instance of an older version, behind the same address as a newer one (a rolling
                # upgrade), refuses a field it does not know. Ask again without it, and from now on.
                field = exc.details.get("field")
                if field == "keep_place" and body.pop("keep_place", False):
                    self._keeps_places = False
                    continue
                if field == "request_id" and body.pop("request_id", None) is not None:
                    self._features -= {"request_id"}
                    if sends > 1:
                        # A try before this one got no answer, and may have been granted: without the request
                        # id, this instance would answer its lease as another's.
                        raise StorageUnavailable(
                            f"the permits service at {self.url} did not answer a request for a new lease under key"
                            f" {key!r}, and the instance that got it again knows no request ids: whether it was"
                            " granted is unknown (if it was, the lease runs out at its TTL)",
                            url=self.url,
                            key=key,
                            owner=owner,
                        ) from exc
                    resendable = False
                    continue
                raise
            self._placeless.discard((owner, key))
            self._unanswered.discard((owner, key))
            return _wire.lease_in(data)

    def wake_calls(self, names: Sequence[str]) -> int | None:
        return None  # the service hears of releases, not this client

    async def wait_for_room(self, names: Sequence[str], seconds: float, since: int | None = None) -> bool:
        """Nothing to wait for here: the service waited for room itself (a long poll) before it answered.
        Unless it allows no wait (``max_wait`` 0): then the client sleeps here, or it would ask again at once
        and for ever."""
        if self._max_wait <= 0:
            await async_sleep(seconds)
        return False

    def queues_in_line(self, wants: Sequence[Want]) -> bool:
        return False  # the service's pre-lock queues a semaphore's waiters in its own memory

    def queue_short(self, owner: str, key: str) -> int | None:
        return None  # the service paces its own waiting

    def holds_place(self, owner: str, key: str) -> bool:
        return False  # the service keeps its own places

    def place_called(self, owner: str, key: str) -> bool:
        return False

    async def release(
        self, owner: str, key: str, one_semaphore: bool = False, request_id: str | None = None
    ) -> ReleaseOutcome:
        body = {"key": key, "owner": owner}
        if request_id is not None:
            await self.open()
            if "release_own" not in self._features:
                raise UsageError(f"the permits service at {self.url} is too old to release by request_id: upgrade it")
            body["request_id"] = request_id
        data = await self._call("POST", "/v1/leases/release", json=body)
        return ReleaseOutcome(data["outcome"])

    async def extend(self, owner: str, key: str, ttl_ms: int | None) -> Lease:
        await self.open()
        if ttl_ms is None and "lease_ttl" not in self._features:
            # An older service would apply its own default: this client's, as before (or the service's, as
            # for a lease acquired without a TTL, where the caller chose none).
            chosen = self._settings.ttl_chosen or self._default_ttl_ms is None
            ttl_ms = self._settings.ttl_ms if chosen else self._default_ttl_ms
        body: dict[str, Any] = {"key": key, "owner": owner}
        if ttl_ms is not None:  # else the lease's own TTL, as the service keeps it
            body["ttl"] = ttl_ms / 1000
        return _wire.lease_in(await self._call("POST", "/v1/leases/extend", json=body))

    async def revoke(self, owner: str, key: str, note: str) -> Lease:
        body = {"key": key, "owner": owner, "reason": note}
        return _wire.lease_in(await self._call("POST", "/v1/leases/revoke", json=body))

    async def get_lease(self, owner: str, key: str) -> Lease:
        data = await self._call("GET", f"/v1/leases/{path_part(key)}", params={"owner": owner})
        return _wire.lease_in(data)

    async def dequeue(self, owner: str, key: str) -> None:
        """Give up the places that the service kept for this request (``keep_place``). A service without
        that feature gave them up when each wait ended; but one that has it may have kept some before an
        older instance refused the field (a rolling upgrade), so the client gives up once it ever asked."""
        if (owner, key) in self._placeless:
            self._placeless.discard((owner, key))
        elif self._kept_places:
            await self._call("POST", "/v1/leases/give-up", json={"key": key, "owner": owner})

    async def waiters(self, name: str) -> list[Waiter]:
        data = await self._call("GET", f"/v1/waiters/{path_part(name)}")
        return [_wire.waiter_in(w) for w in data["waiters"]]

    async def holders(self, name: str) -> list[Holder]:
        data = await self._call("GET", f"/v1/holders/{path_part(name)}")
        return [_wire.holder_in(h) for h in data["holders"]]

    async def create_semaphore(
        self, name: str, capacity: int, by: str, exist_ok: bool, fair: bool = False
    ) -> Semaphore:
        body = {"name": name, "capacity": capacity, "exist_ok": exist_ok, "who": by, "fair": fair}
        return _wire.semaphore_in(await self._call("POST", "/v1/semaphores", json=body))

    async def get_semaphore(self, name: str) -> Semaphore:
        return _wire.semaphore_in(await self._call("GET", f"/v1/semaphores/{path_part(name)}"))

    async def list_semaphores(self, prefix: str) -> list[Semaphore]:
        data = await self._call("GET", "/v1/semaphores", params={"prefix": prefix})
        return [_wire.semaphore_in(s) for s in data["semaphores"]]

    async def set_capacity(self, name: str, capacity: int, by: str, reason: str) -> CapacityChange:
        body = {"capacity": capacity, "reason": reason, "who": by}
        return _wire.change_in(await self._call("PATCH", f"/v1/semaphores/{path_part(name)}", json=body))

    async def capacity_history(self, name: str, limit: int) -> list[CapacityChange]:
        data = await self._call("GET", f"/v1/capacity-history/{path_part(name)}", params={"limit": limit})
        return [_wire.change_in(c) for c in data["changes"]]

    async def delete_semaphore(self, name: str, force: bool) -> int:
        params = {"force": "true" if force else "false"}
        # Not sent again once it may have reached the service: done twice, the second could delete (and, with
        # force, revoke the leases of) a semaphore created under the name in between.
        data = await self._call("DELETE", f"/v1/semaphores/{path_part(name)}", params=params, idempotent=False)
        return int(data["revoked"])

    async def ping(self) -> None:
        await self._call("GET", "/readyz")

    async def sweep(self, batch_size: int, max_batches: int | None) -> SweepResult:
        await self.open()
        if CALLER_DEADLINE.get() is not None or "upkeep_timeout" not in self._features:
            body = {"batch_size": batch_size, "max_batches": max_batches}
            return _wire.sweep_in(await self._upkeep("/v1/sweep", body))
        # No time of the caller's: in parts, each held to SWEEP_PART_SECONDS on the service. One sweep of a
        # long backlog would outlast a reply's wait, and be cut (its outcome unknown) while it went on.
        leases = batches = 0
        keys: list[tuple[str, str]] = []
        while True:
            body = {"batch_size": batch_size, "max_batches": None if max_batches is None else max_batches - batches}
            with caller_deadline(monotonic() + SWEEP_PART_SECONDS):
                part = _wire.sweep_in(await self._upkeep("/v1/sweep", body))
            leases, batches = leases + part.leases, batches + part.batches
            keys.extend(part.keys)
            if part.complete or (max_batches is not None and batches >= max_batches) or not part.batches:
                return SweepResult(leases=leases, batches=batches, keys=keys, complete=part.complete)

    async def reconcile(self, repair: bool) -> list[Drift]:
        data = await self._upkeep("/v1/reconcile", {"repair": repair})
        return [_wire.drift_in(d) for d in data["drift"]]

    async def _upkeep(self, path: str, body: dict[str, Any]) -> Any:
        """A sweep or a reconcile, with the time the caller has left in its body (made anew for each send):
        the service starts no batch (no repair) after it, and answers with what was done; each send waits
        for its answer that long, and the service's grace, as a long poll waits for its wait. A service older
        than that feature is not sent it (it would refuse the field): its work then runs on after the caller
        has given up, as before."""
        await self.open()
        deadline = CALLER_DEADLINE.get()
        while True:
            timed = deadline is not None and "upkeep_timeout" in self._features
            try:
                sends = functools.partial(_with_time_left, body, deadline if timed else None)
                # Not sent again once it may have reached the service: a second sweep (repair) would run
                # beside the first, and the answer would count only its own.
                return await self._call("POST", path, body=sends, idempotent=False)
            except InvalidArgument as exc:
                # An instance of an older version, behind the same address as a newer one (a rolling upgrade),
                # refuses the field: ask again without it, and from now on.
                if not (timed and exc.details.get("field") == "timeout"):
                    raise
                self._features -= {"upkeep_timeout"}

    async def upgrade_schema(self) -> str:
        raise UsageError(
            "the schema belongs to the service's database: run `permits db upgrade --db DATABASE_URL` there"
        )

    async def drop_old_functions(self, dry_run: bool) -> list[str]:
        raise UsageError(
            "server functions belong to the service's database: run `permits db drop-old-functions --db"
            " DATABASE_URL` there"
        )

    # --------------------------------------------------------------------------------------------- driver

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Callable[[], dict[str, Any]] | None = None,
        deadline: float | None = None,
        idempotent: bool = True,
        conflicts_final: bool = False,
        unanswered: tuple[str, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One request, retried on a dropped connection or a retryable refusal; returns the JSON body.

        ``body`` makes the JSON body anew for each send, and its ``wait`` (a long poll) extends the reply's
        timeout. Until ``deadline`` (``monotonic()`` time; an acquire's end of wait) a service that cannot be
        connected to is tried again past ``retries``, and pauses end there. ``idempotent=False``: after a
        failure that may have come once the request was sent (the reply lost), it is not sent again, and
        the caller learns that its outcome is unknown. ``conflicts_final``: a ``StorageConflict`` is raised,
        not sent again (a try that does not wait: the service retried it for a lock wait's time already)."""
        if self._closed:
            raise UsageError("this client is closed")
        self._renew_if_forked()
        self._renew_if_other_loop()
        sent = body() if body is not None else None
        # A request that waits for room is a long poll, and so are its resends: close() cuts those short.
        long_poll = sent is not None and float(sent.get("wait") or 0.0) > 0
        requests = self._long_polls if long_poll else self._requests
        requests.admit()
        try:
            return await self._send(
                requests, method, path, sent, body, deadline, idempotent, conflicts_final, unanswered, kwargs
            )
        finally:
            await requests.done()

    async def _send(
        self,
        requests: _Requests,
        method: str,
        path: str,
        sent: dict[str, Any] | None,
        body: Callable[[], dict[str, Any]] | None,
        deadline: float | None,
        idempotent: bool,
        conflicts_final: bool,
        unanswered: tuple[str, str] | None,
        kwargs: dict[str, Any],
    ) -> Any:
        """``_call``'s sends, the first with ``sent`` as its body. ``unanswered``: the acquire's (owner, key),
        whose unanswered sends are remembered across calls (``_unanswered``)."""
        failures = 0
        # An earlier send of this request may have reached the service and been carried out (its answer
        # was lost, or was a proxy's page, or the service's database failed after a commit): a later
        # refusal that says "not carried out" speaks only for its own send.
        may_have_arrived = unanswered is not None and unanswered in self._unanswered

        def arrived_maybe() -> None:
            nonlocal may_have_arrived
            may_have_arrived = True
            if unanswered is not None:
                if len(self._unanswered) >= MAX_PLACELESS:
                    self._unanswered.clear()  # at worst, a refusal raised as it is
                self._unanswered.add(unanswered)

        while True:
            if failures and body is not None:
                sent = body()
            # A long poll's wait, or the time a sweep or a reconcile is given (the service works that long):
            # its answer may come that much later.
            waits = float(sent.get("wait") or 0.0) + float(sent.get("timeout") or 0.0) if sent is not None else 0.0
            # Past the caller's deadline and the service's grace, a send waits no longer for its answer, and
            # none is sent again for want of one (``permits._deadline``).
            replies = reply_within(RESPONSE_MARGIN + waits, self._grace, self._grace)
            timeout = httpx.Timeout(replies, connect=min(5.0, replies))
            if sent is not None:
                kwargs["json"] = sent
            try:
                response = await requests.send(method, path, timeout=timeout, **kwargs)
            except httpx.TransportError as exc:
                refused = _certificate_refused(exc)
                if refused is not None:
                    # Not retried: an untrusted certificate or another host's stays so, and a caller that
                    # retries a StorageUnavailable would wait on a misconfiguration for ever.
                    raise ConfigurationError(
                        f"the permits service at {self.url} presented a TLS certificate this client does not"
                        f" trust ({refused.verify_message or refused.reason}); if a private CA signed it, point"
                        " SSL_CERT_FILE (or SSL_CERT_DIR) at that CA's certificate",
                        field="url",
                        url=self.url,
                    ) from exc
                if requests is self._long_polls and self._closed:
                    raise UsageError(
                        "this client was closed while it waited for room: the service stops waiting for it (a lease"
                        " it granted in that instant runs out at its TTL)"
                    ) from exc
                not_sent = isinstance(exc, NOT_SENT)
                if not idempotent and not not_sent:
                    raise StorageUnavailable(
                        f"permits service at {self.url} did not answer ({type(exc).__name__}: {exc}); the request"
                        " may have been carried out",
                        url=self.url,
                    ) from exc
                waiting = not_sent and deadline is not None and monotonic() < deadline
                pause = RETRY_BACKOFF.delay(failures) if not waiting else min(MAX_RECONNECT_PAUSE, 0.05 * 2**failures)
                gave_up = past_giving_up(self._grace, pause)
                if (failures >= self._settings.retries and not waiting) or gave_up:
                    unknown = may_have_arrived or not not_sent
                    carried = "; the request may have been carried out" if unknown and method != "GET" else ""
                    raise StorageUnavailable(
                        f"permits service unavailable at {self.url}: {type(exc).__name__}: {exc}{carried}",
                        url=self.url,
                    ) from exc
                if not not_sent:
                    arrived_maybe()
                await async_sleep(_within(pause, deadline))
                failures += 1
                continue
            if response.is_success:
                return response.json()
            error = _error_from(response)
            pause = _retry_after(response) or RETRY_BACKOFF.delay(failures)
            # A proxy's failure page and the service's unavailability are no answer to the request: past the
            # caller's deadline and the service's grace it is not sent again for them. A conflict is an answer.
            no_answer = error is None or isinstance(error, StorageUnavailable | ServiceUnavailable)
            gave_up = no_answer and past_giving_up(self._grace, _within(pause, deadline))
            if error is None:  # a proxy's failure page: the request may or may not have reached the service
                if not idempotent:
                    raise StorageUnavailable(
                        f"a proxy in front of the permits service at {self.url} answered {response.status_code};"
                        " the request may have been carried out",
                        url=self.url,
                    )
                if failures >= self._settings.retries or gave_up:
                    raise StorageUnavailable(
                        f"permits service unavailable at {self.url}: a proxy in front of it answered"
                        f" {response.status_code}",
                        url=self.url,
                    )
            elif (
                not error.retryable
                or failures >= self._settings.retries
                or gave_up
                or isinstance(error, AcquireTimeout)
                or (conflicts_final and isinstance(error, StorageConflict))
                or not (idempotent or isinstance(error, NOT_CARRIED_OUT))
            ):
                if may_have_arrived and method != "GET" and isinstance(error, NOT_CARRIED_OUT):
                    # ``refused``: the service answered (a caller riding out an outage need not call it one).
                    raise StorageUnavailable(
                        f"permits service at {self.url} refused the request ({error.code}: {error}) after an"
                        " earlier send of it got no answer: the request may have been carried out",
                        url=self.url,
                        refused=error.code,
                    ) from error
                raise error
            if error is None or isinstance(error, StorageUnavailable):
                arrived_maybe()
            logger.debug("retrying after %s from the service", response.status_code if error is None else error.code)
            await async_sleep(_within(pause, deadline))
            failures += 1


def _within(pause: float, deadline: float | None) -> float:
    """A pause before sending again, cut short at ``deadline`` (not below a short backoff, so that a
    request past its deadline is still sent again once, and answered)."""
    if deadline is None:
        return pause
    return min(pause, max(RETRY_BACKOFF.delay(0), deadline - monotonic()))


def _error_from(response: httpx.Response) -> PermitsError | None:
    """The exception the embedded library would have raised, from the service's error body; ``None`` for a
    proxy's 502, 503 or 504 (no permits error body)."""
    try:
        error = response.json()["error"]
        code, message = str(error["code"]), str(error["message"])
        details = dict(error.get("details") or {})
    except (ValueError, KeyError, TypeError):
        if response.status_code in PROXY_FAILURES:
            return None
        return ServiceError(
            f"the service answered {response.status_code} without a permits error body",
            status=response.status_code,
        )
    cls = error_class(code)
    if cls is PermitsError:  # a code this version does not know (or a route the service does not have)
        cls = ServiceError
    try:
        return cls(message, **details)
    except TypeError:  # details that the class does not take as keywords: keep the message
        return cls(message)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After", "")
    try:
        return min(MAX_RETRY_AFTER, max(0.0, float(value)))
    except ValueError:
        return None
