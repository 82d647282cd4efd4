"""The /v1 API: thin handlers that check the caller, call the library, and write ``permits._wire`` JSON.

Names and keys appear in paths only as the last segment, percent-encoded (a name may contain ``/``);
actions on a lease take its key in the body (``POST /v1/leases/release``), so no name or key can ever be
mistaken for a route. That segment is read whole, line breaks included (``{name:text}``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Iterator
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.responses import JSONResponse
from starlette.convertors import PathConvertor, register_url_convertor

import permits
from permits import _validate, _wire
from permits._core import flows
from permits._deadline import caller_deadline, store_least_reply
from permits._exceptions import (
    ENDS_THE_REQUEST,
    AcquireTimeout,
    IdempotencyConflict,
    InvalidArgument,
    LimitExceeded,
    PermitsError,
)
from permits._io import monotonic
from permits._models import Lease
from permits.server import admin, body, gone, schemas
from permits.server.auth import Identity
from permits.server.state import ServiceState


class _TextConvertor(PathConvertor):
    """The rest of the path, like ``{x:path}``, newlines included. Starlette's ``path`` is ``.*``, whose dot
    stops at a newline, and its route pattern ends in ``$``, which also matches before a final newline:
    ``/v1/semaphores/db%0A`` would have named the semaphore ``db``, and a DELETE would have deleted it."""

    regex = "[\\s\\S]*"


register_url_convertor("text", _TextConvertor())

router = APIRouter(prefix="/v1", route_class=body.Route)
#: What this service supports beyond the first API (``GET /v1/whoami``), for clients of another version:
#: ``keep_place`` (an acquire's field, and ``POST /v1/leases/give-up``); ``new_only`` (an acquire's field);
#: ``lease_ttl`` (an extend without ``ttl`` renews by the lease's own TTL, not the service's default);
#: ``request_id`` (an acquire's field: a ``new_only`` request's retries know its lease as their own);
#: ``release_own`` (a release's ``request_id``: only the lease that request got); ``upkeep_timeout`` (a sweep's
#: and a reconcile's ``timeout``: no batch, no repair, starts after it).
FEATURES = ("keep_place", "new_only", "lease_ttl", "request_id", "release_own", "upkeep_timeout")

# The error statuses each route may answer with, as its OpenAPI operation lists them (errors.py maps each
# error to its status). Every route: 401 without a valid token, 422 for bad input (a query parameter
# given twice, a body on a GET or DELETE, a field out of bounds) and, where it asks the database, 503 when
# that is unavailable (acquire's also while the instance shuts down, or its queue is slow). A route that
# takes a body: 413 for one over the size limit (DELETE's too, whose body is refused). 403 only on admin
# routes; 429 only on acquire (a token's lease quota, an instance's waiters) and the dashboard's event
# stream (its streams); 410 only where a lease that ran out is an error (acquire under the key of one,
# extend); 409 for the conflicts named at each. An unexpected failure is a bare 500, on any route, and is
# not listed.
#: what every route that reads the database may answer with (the dashboard's routes too)
READ = (401, 422, 503)
_WRITE = (*READ, 413)
_ADMIN = (*_WRITE, 403)


async def _state(request: Request) -> ServiceState:
    # async, like every dependency here: FastAPI runs a plain function on a worker thread.
    state: ServiceState = request.app.state.permits
    return state


#: Set in the request's state by the body middleware (app.py) when a body came as something other than
#: JSON: the media type it named. Refused by the caller's dependency, after routing, authentication and
#: the admin check, so that the answer is the one the request would get anyway (404, 405, 401, 403) before
#: the one about its body.
WRONG_BODY_TYPE = "wrong_body_type"


async def _authenticated(request: Request) -> Identity:
    identity = (await _state(request)).auth.identify(request.headers.get("authorization"))
    request.state.identity = identity
    return identity


def _refuse_wrong_body_type(request: Request) -> None:
    wrong = getattr(request.state, WRONG_BODY_TYPE, None)
    if wrong is not None:
        raise InvalidArgument(f"a request body is JSON (Content-Type: application/json), not {wrong}", field="body")


async def _identity(request: Request) -> Identity:
    identity = await _authenticated(request)
    _refuse_wrong_body_type(request)
    return identity


class _AdminOnly:
    """A dependency: the caller, who must hold an admin token to take ``action``. Checked in a dependency
    rather than in the handler because FastAPI resolves dependencies before it validates the parameters
    and the body: a client token is told 403 before anything about its input."""

    def __init__(self, action: str) -> None:
        self.action = action

    async def __call__(self, request: Request) -> Identity:
        identity = await _authenticated(request)
        identity.require_admin(self.action)
        _refuse_wrong_body_type(request)
        return identity


def _dependency_calls(dependant: Any) -> Iterator[Any]:
    """Every dependency a route resolves, those of its dependencies included."""
    for sub in getattr(dependant, "dependencies", ()):
        yield sub.call
        yield from _dependency_calls(sub)


async def refuse_caller(request: Request) -> None:
    """Raise what the matched route's caller dependency would raise (401, 403), for a request that the
    framework refused before any dependency ran: a body that is not valid JSON is parsed, and refused,
    first. Nothing when there is no route, or the caller passes."""
    calls = list(_dependency_calls(getattr(request.scope.get("route"), "dependant", None)))
    if not any(call is _identity or isinstance(call, _AdminOnly) for call in calls):
        return
    identity = await _authenticated(request)
    for call in calls:
        if isinstance(call, _AdminOnly):
            identity.require_admin(call.action)


State = Annotated[ServiceState, Depends(_state)]
Caller = Annotated[Identity, Depends(_identity)]


def _lease_json(lease: Lease, identity: Identity, asked_owner: str | None) -> dict[str, Any]:
    shown = dataclasses.replace(lease, owner=identity.client_owner(lease.owner, asked_owner))
    return _wire.lease_out(shown)


def lease_location(lease: dict[str, Any], asked_owner: str | None, root_path: str = "") -> dict[str, str]:
    """The ``Location`` of a lease just granted: where ``GET`` reads it, with the owner as the client named it
    (none named: the identity's own leases, which a ``GET`` without one reads)."""
    path = f"{root_path}/v1/leases/{quote(lease['key'], safe='')}"
    return {"Location": path if asked_owner is None else f"{path}?owner={quote(asked_owner, safe='')}"}


def _check_ttl(ttl: float | None, max_ttl: float) -> None:
    """The library's checks of a ttl, then this service's bound, in seconds as the document states it."""
    if ttl is not None:
        _validate.ttl_ms(ttl)
        if ttl > max_ttl:
            raise InvalidArgument(f"ttl is at most {max_ttl:g} s on this service", field="ttl")


def _who(identity: Identity, who: str | None) -> str:
    return identity.db_owner(None if who is None else _validate.who(who), field="who")


# ---------------------------------------------------------------------------------------------- whoami


def held_to_arrival() -> caller_deadline:
    """The database work of a request that does not wait, held to its arrival, as an acquire's attempts are
    held to its wait: over a link to the database that hangs, the store gives up after one reply's least wait
    and its grace, and the answer is a 503 that the client may send again; not minutes of the store's
    retries, with every resend another handler waiting beside the first (docs/deployment.md, "A link that
    hangs"). Not for a sweep or a reconcile, whose batches a large database may keep busy for longer (they
    hold to the timeout their caller sends), nor for a semaphore's delete (see there). On a database that is
    merely slow it gives up sooner too: a pooled connection is waited for 10 s, not 30, and a transaction's
    reply 15 s, not 20 (the defaults)."""
    return caller_deadline(monotonic())


@router.get("/whoami", response_model=schemas.WhoAmIOut, responses=schemas.error_responses(401, 422), tags=["service"])
async def whoami(identity: Caller, state: State) -> dict[str, Any]:
    """The identity of the token, whether it is an admin, and the bounds this service sets."""
    limits = state.config.limits
    return {
        "identity": identity.name,
        "admin": identity.admin,
        "version": permits.__version__,
        "limits": {
            "max_wait": limits.max_wait,
            "max_ttl": limits.max_ttl,
            "max_wants": limits.max_wants,
            "default_ttl": state.client.default_ttl,
            "answer_grace": state.config.prelock_wait + store_least_reply(state.config.lock_wait_timeout),
        },
        "features": list(FEATURES),
    }


# ---------------------------------------------------------------------------------------------- leases


@router.post(
    "/leases",
    status_code=201,
    response_model=schemas.LeaseOut,
    # 404 a semaphore; 409 no room (acquire_timeout), another request's key (idempotency_conflict, key_in_use)
    responses=schemas.error_responses(*_WRITE, 404, 409, 410, 429),
    tags=["leases"],
)
async def acquire(body: schemas.AcquireIn, identity: Caller, state: State, request: Request) -> JSONResponse:
    """Take every wanted permit or none, waiting up to ``wait`` seconds for room.

    201 with the lease; 409 ``acquire_timeout`` when there was no room within the wait. A retry with the
    same ``key`` returns the same lease and never grants twice. A request whose client closes the connection
    stops waiting (and is not granted afterwards).
    """
    async with gone.watching_if(bool(body.wait), request.receive):
        lease = await acquire_lease(body, identity, state)
    return JSONResponse(lease, status_code=201, headers=lease_location(lease, body.owner, request.scope["root_path"]))


async def acquire_lease(body: schemas.AcquireIn, identity: Identity, state: ServiceState) -> dict[str, Any]:
    """What ``POST /v1/leases`` does once its caller and body are checked: the lease's JSON (status 201).
    Shared with the hot routes (``permits.server.hot``), which call it without the framework."""
    limits = state.config.limits
    pairs = body.want_pairs()
    try:
        if len(pairs) > limits.max_wants:
            raise InvalidArgument(
                f"a request may name at most {limits.max_wants} semaphores on this service", field="wants"
            )
        wait = _validate.timeout(body.wait, "wait") or 0.0
        if wait > limits.max_wait:
            raise InvalidArgument(f"wait is at most {limits.max_wait:g} s on this service", field="wait")
        _check_ttl(body.ttl, limits.max_ttl)
        owner = identity.db_owner(body.owner)
        key = body.key if body.key is not None else uuid.uuid4().hex
        try:
            # Its reads, where it makes any, held to the request's wait, as the attempts are.
            await state.check_lease_quota(identity, owner, body.key, deadline=monotonic() + wait)
        except LimitExceeded:
            _validate.wants(pairs)  # bad input is a 422 whatever the quota: a 429 would say "retry"
            state.metrics.acquires.labels("limited").inc()
            raise
    except InvalidArgument:
        state.metrics.acquires.labels("rejected").inc()  # as bad input the database refuses (below)
        raise

    started = monotonic()
    outcome = "error"
    names = [n for n, _ in pairs]
    try:
        if wait > 0:
            with state.instance_stats.waiting(names):
                lease = await state.client.acquire(
                    pairs,
                    key=key,
                    owner=owner,
                    ttl=body.ttl,
                    timeout=wait,
                    new_only=body.new_only,
                    request_id=body.request_id,
                )
        else:
            found = await state.client.try_acquire(
                pairs, key=key, owner=owner, ttl=body.ttl, new_only=body.new_only, request_id=body.request_id
            )
            if found is None:
                outcome = "refused"
                described = ", ".join(f"{n}:{c}" for n, c in sorted(pairs))
                raise AcquireTimeout(f"no room for {described}", key=key, owner=owner, timeout=0.0)
            lease = found
        outcome = "granted"
    except AcquireTimeout as exc:
        outcome = "refused" if wait == 0 else "gone" if isinstance(exc, gone.ClientGone) else "timeout"
        if wait > 0 and (not body.keep_place or outcome == "gone"):
            # The request is over: its place in a fair queue goes now, not when it expires (PLACE_MS). A
            # stream of requests that time out would otherwise keep a dead place at the head of the queue,
            # and every live waiter behind it would time out in turn (tests/service/test_fair_places.py).
            # A client that went away gets no 409 to ask again after, so it keeps no place either: its
            # give-up may have come before this request's last attempt renewed the place.
            with contextlib.suppress(PermitsError):
                await state.sql_store.dequeue(owner, key)
        # Say whether a place was kept (a plain semaphore has none, and a request that did not ask to keep
        # its place gave it up), so that a client that stops waiting sends its give-up, a request and a
        # write, only when there is one to give up. Every 409 acquire_timeout says it, true or false.
        kept = wait > 0 and outcome == "timeout" and body.keep_place
        exc.details["kept_place"] = kept and state.sql_store.holds_place(owner, key)
        raise
    except ENDS_THE_REQUEST as exc:
        # The caller's mistake, not the service's: "error" is kept for what an operator must look at.
        outcome = "conflict" if isinstance(exc, IdempotencyConflict) else "rejected"
        if wait > 0:
            # A verdict (another's lease under the key, the capacity lowered below the count, a semaphore
            # deleted) ends the request, kept place or not: its places go now, not when they lapse.
            with contextlib.suppress(PermitsError):
                await state.sql_store.dequeue(owner, key)
        raise
    except LimitExceeded:  # too many waiting on this instance (max_waiters)
        outcome = "limited"
        raise
    finally:
        elapsed = monotonic() - started
        state.instance_stats.outcome(names, outcome, elapsed)
        state.metrics.acquires.labels(outcome).inc()
        state.metrics.acquire_seconds.labels(outcome).observe(elapsed)
        if outcome == "granted":
            state.metrics.acquire_wait_seconds.observe(elapsed)
    state.note_granted(identity)
    return _lease_json(lease, identity, body.owner)


@router.post(
    "/leases/release", response_model=schemas.ReleaseOut, responses=schemas.error_responses(*_WRITE), tags=["leases"]
)
async def release(body: schemas.ReleaseIn, identity: Caller, state: State) -> dict[str, Any]:
    """Give a lease's permits back: ``released``, ``already_released``, ``lost`` (it had ended by expiry or
    revocation before) or ``not_found``. Idempotent. With ``request_id``, only the lease that request got."""
    return await release_lease(body, identity, state)


async def release_lease(body: schemas.ReleaseIn, identity: Identity, state: ServiceState) -> dict[str, Any]:
    """What ``POST /v1/leases/release`` does once its caller and body are checked (status 200). Shared with
    the hot routes (``permits.server.hot``)."""
    with held_to_arrival():
        owner = identity.db_owner(body.owner)
        outcome = await state.client.release(body.key, owner=owner, request_id=body.request_id)
    state.metrics.releases.labels(str(outcome)).inc()
    return {"outcome": str(outcome)}


@router.post(
    "/leases/extend",
    response_model=schemas.LeaseOut,
    responses=schemas.error_responses(*_WRITE, 404, 410),
    tags=["leases"],
)
async def extend(body: schemas.ExtendIn, identity: Caller, state: State) -> dict[str, Any]:
    """Push a held lease's expiry to now + ``ttl`` on the database's clock; 410 ``lease_lost`` if it ended."""
    _check_ttl(body.ttl, state.config.limits.max_ttl)
    with held_to_arrival():
        lease = await state.client.extend(body.key, body.ttl, owner=identity.db_owner(body.owner))
    return _lease_json(lease, identity, body.owner)


@router.post(
    "/leases/give-up", response_model=schemas.GiveUpOut, responses=schemas.error_responses(*_WRITE), tags=["leases"]
)
async def give_up(body: schemas.LeaseRefIn, identity: Caller, state: State) -> dict[str, Any]:
    """Give up the places in fair queues that a request kept (``keep_place``) when it stopped waiting:
    the places behind them move up now, not when they expire. Idempotent; ``places`` is 0 when there
    were none."""
    owner, key = _validate.owner(identity.db_owner(body.owner)), _validate.key(body.key)
    with held_to_arrival():
        places = await state.sql_store.run_flow(lambda: flows.dequeue(owner, key))
    return {"places": places}


@router.post(
    "/leases/revoke", response_model=schemas.LeaseOut, responses=schemas.error_responses(*_ADMIN, 404), tags=["admin"]
)
async def revoke(
    body: schemas.RevokeIn, identity: Annotated[Identity, Depends(_AdminOnly("revoking a lease"))], state: State
) -> dict[str, Any]:
    """End anyone's lease now, recording why (admin). ``owner`` is the owner as stored, as the holders list
    shows it. The holder finds out at its next extend (410, reason ``revoked``)."""
    with held_to_arrival():
        lease = await admin.revoke(state, identity, body.owner, body.key, reason=body.reason)
    return _wire.lease_out(lease)


@router.get(
    "/leases/{key:text}",
    response_model=schemas.LeaseOut,
    responses=schemas.error_responses(*READ, 404),
    tags=["leases"],
)
async def get_lease(
    key: schemas.KeyInPath, identity: Caller, state: State, owner: schemas.OwnerInQuery = None
) -> dict[str, Any]:
    """One of your leases, held or ended; 404 when there is none under this key (or it is not yours)."""
    with held_to_arrival():
        lease = await state.client.get_lease(key, owner=identity.db_owner(owner))
    return _lease_json(lease, identity, owner)


# ------------------------------------------------------------------------------------------ semaphores


@router.get(
    "/semaphores",
    response_model=schemas.SemaphoreListOut,
    responses=schemas.error_responses(*READ),
    tags=["semaphores"],
)
async def list_semaphores(identity: Caller, state: State, prefix: str = "") -> dict[str, Any]:
    """Every semaphore whose name starts with ``prefix``, by name."""
    with held_to_arrival():
        found = await state.client.list_semaphores(prefix)
    return {"semaphores": [_wire.semaphore_out(s) for s in found]}


@router.post(
    "/semaphores",
    status_code=201,
    response_model=schemas.SemaphoreOut,
    # 409 semaphore_exists; 404 when one made at the same moment by another request is deleted before it is read
    responses=schemas.error_responses(*_ADMIN, 404, 409),
    tags=["semaphores"],
)
async def create_semaphore(
    body: schemas.CreateSemaphoreIn,
    identity: Annotated[Identity, Depends(_AdminOnly("creating a semaphore"))],
    state: State,
    request: Request,
) -> JSONResponse:
    """Create a semaphore (admin). With ``exist_ok``, one of the same capacity is returned instead of 409."""
    with held_to_arrival():
        sem = await admin.create_semaphore(
            state,
            identity,
            body.name,
            body.capacity,
            exist_ok=body.exist_ok,
            fair=body.fair,
            who=_who(identity, body.who),
            reason=body.reason,
        )
    where = f"{request.scope['root_path']}/v1/semaphores/{quote(sem.name, safe='')}"
    return JSONResponse(_wire.semaphore_out(sem), status_code=201, headers={"Location": where})


@router.get(
    "/semaphores/{name:text}",
    response_model=schemas.SemaphoreOut,
    responses=schemas.error_responses(*READ, 404),
    tags=["semaphores"],
)
async def get_semaphore(name: schemas.NameInPath, identity: Caller, state: State) -> dict[str, Any]:
    """Capacity, use and last fencing token of one semaphore."""
    with held_to_arrival():
        return _wire.semaphore_out(await state.client.get_semaphore(name))


@router.patch(
    "/semaphores/{name:text}",
    response_model=schemas.CapacityChangeOut,
    responses=schemas.error_responses(*_ADMIN, 404),
    tags=["semaphores"],
)
async def set_capacity(
    name: schemas.NameInPath,
    body: schemas.SetCapacityIn,
    identity: Annotated[Identity, Depends(_AdminOnly("changing a capacity"))],
    state: State,
) -> dict[str, Any]:
    """Change a capacity, with a reason kept in its history (admin). Lowering it revokes nothing."""
    with held_to_arrival():
        change = await admin.set_capacity(
            state, identity, name, body.capacity, reason=body.reason, who=_who(identity, body.who)
        )
    return _wire.change_out(change)


@router.delete(
    "/semaphores/{name:text}",
    response_model=schemas.DeletedOut,
    responses=schemas.error_responses(*_ADMIN, 404, 409),  # 409 semaphore_in_use
    tags=["semaphores"],
)
async def delete_semaphore(
    name: schemas.NameInPath,
    identity: Annotated[Identity, Depends(_AdminOnly("deleting a semaphore"))],
    state: State,
    force: Annotated[bool, Query()] = False,
    reason: Annotated[
        str | None, Query(max_length=_validate.MAX_REASON_LENGTH, json_schema_extra={"pattern": schemas.NO_NUL})
    ] = None,
) -> dict[str, Any]:
    """Delete a semaphore (admin); 409 ``semaphore_in_use`` while permits are held, unless ``force``, which
    revokes those leases. Its fencing tokens are kept for a semaphore created again under the name. The
    ``reason`` goes to the admin log."""
    # Not held to its arrival (held_to_arrival): a delete is the one request a client does not send again
    # after a 503 storage_unavailable (a second one could delete a semaphore made again meanwhile), and a
    # forced one ends every lease that holds the semaphore, in one transaction.
    revoked = await admin.delete_semaphore(state, identity, name, force=force, reason=reason)
    return {"deleted": name, "revoked": revoked}


@router.get(
    "/holders/{name:text}",
    response_model=schemas.HoldersOut,
    responses=schemas.error_responses(*READ, 404),
    tags=["semaphores"],
)
async def holders(name: schemas.NameInPath, identity: Caller, state: State) -> dict[str, Any]:
    """The leases holding permits of ``name``, in token order. A client token sees the keys of its own
    leases only."""
    with held_to_arrival():
        found = await state.client.holders(name)
    return {
        "name": name,
        "holders": [_wire.holder_out(h, show_key=identity.admin or identity.owns(h.owner)) for h in found],
    }


@router.get(
    "/waiters/{name:text}",
    response_model=schemas.WaitersOut,
    responses=schemas.error_responses(*READ, 404),
    tags=["semaphores"],
)
async def waiters(name: schemas.NameInPath, identity: Caller, state: State) -> dict[str, Any]:
    """The requests waiting for room on a fair semaphore, in queue order (a client token sees the keys of
    its own only)."""
    with held_to_arrival():
        found = await state.client.waiters(name)
    return {
        "name": name,
        "waiters": [_wire.waiter_out(w, show_key=identity.admin or identity.owns(w.owner)) for w in found],
    }


@router.get(
    "/capacity-history/{name:text}",
    response_model=schemas.CapacityHistoryOut,
    responses=schemas.error_responses(*READ, 404),
    tags=["semaphores"],
)
async def capacity_history(
    name: schemas.NameInPath, identity: Caller, state: State, limit: Annotated[int, Query(ge=1, le=10_000)] = 100
) -> dict[str, Any]:
    """Capacity changes of ``name``, newest first (its creation included)."""
    with held_to_arrival():
        changes = await state.client.capacity_history(name, limit=limit)
    return {"changes": [_wire.change_out(c) for c in changes]}


# --------------------------------------------------------------------------------------------- upkeep


@router.post("/sweep", response_model=schemas.SweepOut, responses=schemas.error_responses(*_ADMIN), tags=["admin"])
async def sweep(
    identity: Annotated[Identity, Depends(_AdminOnly("sweeping"))],
    state: State,
    body: Annotated[schemas.SweepIn | None, Body()] = None,
) -> dict[str, Any]:
    """End every expired lease now, in short batches (admin). The service also does this on its own.
    Every field has a default, so the body may be left out (``curl -X POST .../v1/sweep``). With a
    ``timeout``, no batch starts after it, and the answer says whether the sweep was complete."""
    identity.require_admin("sweeping")  # again, as each admin action checks itself (see _AdminOnly)
    body = body or schemas.SweepIn()
    result = await state.client.sweep(batch_size=body.batch_size, max_batches=body.max_batches, timeout=body.timeout)
    if result.leases:
        state.metrics.reclaims.labels("swept").inc(result.leases)
    return _wire.sweep_out(result)


@router.post(
    "/reconcile", response_model=schemas.ReconcileOut, responses=schemas.error_responses(*_ADMIN), tags=["admin"]
)
async def reconcile(
    identity: Annotated[Identity, Depends(_AdminOnly("reconciling"))],
    state: State,
    body: Annotated[schemas.ReconcileIn | None, Body()] = None,
) -> dict[str, Any]:
    """Compare each semaphore's count with its permit rows, and repair drift if asked (admin). The body
    may be left out: a check that repairs nothing. With a ``timeout``, no repair starts after it, and the
    drift left is answered as found (``repaired`` false)."""
    identity.require_admin("reconciling")  # again, as each admin action checks itself (see _AdminOnly)
    body = body or schemas.ReconcileIn()
    drift = await state.client.reconcile(repair=body.repair, timeout=body.timeout)
    return {"drift": [_wire.drift_out(d) for d in drift]}
