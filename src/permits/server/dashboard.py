"""The dashboard: the page at ``/``, its assets, and the read-only API it draws from (see
docs/dashboard.md). Admin actions go through the ordinary API (``routes``), which logs them.

The page itself is a static shell with no data in it. Every number comes from /v1 endpoints, which need
a token like the rest of the API (none in open mode, which listens on loopback only).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from permits import _validate
from permits._core import observe
from permits._models import ms_to_datetime
from permits.server import body, events, schemas
from permits.server.routes import READ, Caller, State, held_to_arrival

router = APIRouter(route_class=body.Route)

#: Seconds between comment lines on an idle stream, so proxies and browsers keep it open.
STREAM_PING_SECONDS = 15.0
#: The page's own policy: no inline script or style, nothing from elsewhere, no framing.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
_STATIC = resources.files("permits.server") / "static"
#: The window of the overview's sparklines and of the semaphore page's charts.
HOUR_MINUTES = 60
#: An instance's report counts as current for this many steps.
FRESH_STEPS = 3


def _asset(name: str) -> tuple[bytes, str]:
    suffix = name[name.rfind(".") :] if "." in name else ""
    entry = _STATIC / name
    if "/" in name or name.startswith(".") or suffix not in _TYPES or not entry.is_file():
        raise HTTPException(status_code=404, detail="no such dashboard file")
    return entry.read_bytes(), f"{_TYPES[suffix]}; charset=utf-8"


def _page_headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }


@router.get("/", include_in_schema=False)
async def page() -> Response:
    body, kind = _asset("index.html")
    return Response(body, media_type=kind, headers=_page_headers())


@router.get("/ui/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    body, kind = _asset(name)
    return Response(body, media_type=kind, headers=_page_headers())


@router.get("/v1/overview", responses=schemas.error_responses(*READ), tags=["dashboard"])
async def overview(identity: Caller, state: State, prefix: str = "") -> dict[str, Any]:
    """Every semaphore now, with its last hour's utilisation per minute and its refusal and timeout rates."""
    step_ms = round(state.config.dashboard.step * 1000)
    fresh_ms = FRESH_STEPS * step_ms
    with held_to_arrival():  # as the API's reads: polled, they must not pile up over a link that hangs
        snapshot = await state.sql_store.run_flow(
            lambda: observe.overview_rows(HOUR_MINUTES * observe.MINUTE_MS, max(5 * observe.MINUTE_MS, fresh_ms)),
            readonly=True,
        )
    now_ms = int(snapshot.semaphores[0][5]) if snapshot.semaphores else _latest(snapshot)
    util = observe.utilisation_by_minute(snapshot.minutes, now_ms, HOUR_MINUTES)
    waiting = observe.waiting_now(snapshot.instances, now_ms, fresh_ms)
    rates = observe.per_minute_rates(snapshot.instances, now_ms, 5 * observe.MINUTE_MS)
    rows = []
    for name, capacity, used, last_token, queued, _, fair in sorted(snapshot.semaphores, key=lambda r: str(r[0])):
        name, capacity, used = str(name), int(capacity), int(used)
        if not name.startswith(prefix):
            continue
        refused, timeouts = rates.get(name, (0.0, 0.0))
        rows.append(
            {
                "name": name,
                "capacity": capacity,
                "used": used,
                "available": max(0, capacity - used),
                # Fair queues are in the database; other waiters are known to the instances they wait on.
                "waiting": max(int(queued), waiting.get(name, 0)),
                "full": used >= capacity,
                "fair": bool(fair),
                "last_token": str(last_token),
                "util": util.get(name, [None] * HOUR_MINUTES),
                "refused_per_min": round(refused, 2),
                "timeouts_per_min": round(timeouts, 2),
            }
        )
    return {
        "now": ms_to_datetime(now_ms).isoformat(),
        "step_seconds": state.config.dashboard.step,
        "instances": observe.instances_up(snapshot.instances, now_ms, fresh_ms),
        "semaphores": rows,
    }


def _latest(snapshot: observe.Snapshot) -> int:
    if snapshot.instances:
        return int(snapshot.instances[0][8])
    return 0


@router.get("/v1/stats/{name:text}", responses=schemas.error_responses(*READ, 404), tags=["dashboard"])
async def stats(
    name: schemas.NameInPath,
    identity: Caller,
    state: State,
    minutes: Annotated[int, Query(ge=1, le=120)] = HOUR_MINUTES,
) -> dict[str, Any]:
    """One point per minute for a semaphore's charts: utilisation, grants, refusals, timeouts, wait and
    hold times (p50 and p99)."""
    name = _validate.name(name)
    window_ms = minutes * observe.MINUTE_MS
    with held_to_arrival():
        await state.client.get_semaphore(name)  # 404 for a name that does not exist
        samples, seen = await state.sql_store.run_flow(lambda: observe.semaphore_series(name, window_ms), readonly=True)
        now_ms = await _now_ms(state)
    points = observe.minute_points(samples, seen, now_ms, minutes)
    for point in points:
        point["t"] = ms_to_datetime(point.pop("t_ms")).isoformat()
    return {"name": name, "step_seconds": 60, "points": points}


async def _now_ms(state: Any) -> int:
    now: int = await state.sql_store.run_flow(observe.clock, readonly=True)
    return now


@router.get("/v1/endings/{name:text}", responses=schemas.error_responses(*READ, 404), tags=["dashboard"])
async def endings(
    name: schemas.NameInPath, identity: Caller, state: State, limit: Annotated[int, Query(ge=1, le=1000)] = 50
) -> dict[str, Any]:
    """Recent lease endings of a semaphore, newest first, with their reason (released, expired, swept,
    owner_dead, revoked, stale)."""
    name = _validate.name(name)
    with held_to_arrival():
        await state.client.get_semaphore(name)
        rows = await state.sql_store.run_flow(lambda: observe.endings(name, limit), readonly=True)
    out = []
    for owner, key, count, token, acquired_ms, ended_ms, reason, note in rows:
        shown = identity.admin or identity.owns(str(owner))
        out.append(
            {
                "owner": str(owner),
                "key": str(key) if shown else None,
                "count": int(count),
                "token": str(token),
                "acquired_at": ms_to_datetime(int(acquired_ms)).isoformat(),
                "ended_at": None if ended_ms is None else ms_to_datetime(int(ended_ms)).isoformat(),
                "held_seconds": None if ended_ms is None else round((int(ended_ms) - int(acquired_ms)) / 1000, 3),
                "reason": None if reason is None else str(reason),
                "note": None if note is None else str(note),
            }
        )
    out.sort(key=lambda e: e["ended_at"] or "", reverse=True)
    return {"name": name, "endings": out}


@router.get("/v1/admin-log", responses=schemas.error_responses(*READ), tags=["dashboard"])
async def admin_log(
    identity: Caller, state: State, name: schemas.NameInQuery = None, limit: Annotated[int, Query(ge=1, le=1000)] = 50
) -> dict[str, Any]:
    """Admin actions taken through the service, newest first, with who and why."""
    wanted = None if name is None else _validate.name(name)
    with held_to_arrival():
        rows = await state.sql_store.run_flow(lambda: observe.admin_log(wanted, limit), readonly=True)
    entries = []
    for _id, at_ms, actor, action, sem, lease_owner, lease_key, reason, detail in rows:
        shown = lease_owner is None or identity.admin or identity.owns(str(lease_owner))
        entries.append(
            {
                "at": ms_to_datetime(int(at_ms)).isoformat(),
                "actor": str(actor),
                "action": str(action),
                "name": None if sem is None else str(sem),
                "owner": None if lease_owner is None else str(lease_owner),
                "key": None if lease_key is None or not shown else str(lease_key),
                "reason": str(reason),
                "detail": None if detail is None else str(detail),
            }
        )
    return {"entries": entries}


@router.get("/v1/events", responses=schemas.error_responses(*READ), tags=["dashboard"])
async def events_poll(identity: Caller, state: State, since: schemas.CursorInQuery = None) -> dict[str, Any]:
    """Events after ``since`` (a cursor from an earlier answer), oldest first, and the cursor to ask with
    next. Without ``since``: no events, and the cursor of now. An ending may come twice (the feed re-reads
    a short overlap, because an ending's time is taken before its commit): drop repeats by ``lease_id``."""
    if since is None:
        with held_to_arrival():
            cursor = await state.sql_store.run_flow(events.head, readonly=True)
        return {"cursor": str(cursor), "events": [], "skipped": False}
    start = events.Cursor.parse(since)
    with held_to_arrival():
        batch = await state.sql_store.run_flow(lambda: events.read_since(start), readonly=True)
    return {
        "cursor": str(batch.cursor),
        "events": [events.shown_to(e, identity) for e in batch.events],
        "skipped": batch.skipped,
    }


class _Stream(StreamingResponse):
    """A stream that lets its subscription go however it ends: the generator's own clean-up runs only if
    it started, and a response cancelled before its first part (its client gone while the headers were
    being sent) never starts it."""

    def __init__(self, *args: Any, on_end: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


@router.get(
    "/v1/events/stream",
    responses={
        **schemas.error_responses(*READ, 429),  # 429: the instance's max_streams
        200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}},
    },
    response_class=StreamingResponse,
    tags=["dashboard"],
)
async def events_stream(
    identity: Caller,
    state: State,
    since: schemas.CursorInQuery = None,
    last_event_id: Annotated[str | None, Header(json_schema_extra={"pattern": schemas.CURSOR})] = None,
) -> StreamingResponse:
    """The event feed as server-sent events: ``id:`` is the cursor to resume from (``since=`` or
    ``Last-Event-ID``, on any instance), ``event:`` the type, ``data:`` the event as JSON."""
    if since is not None:
        start = events.Cursor.parse(since)
    elif last_event_id is not None:  # a browser's EventSource resuming: the error names the header
        start = events.Cursor.parse(last_event_id, field="last-event-id")
    else:
        with held_to_arrival():  # as events_poll's: browsers reconnect their streams
            start = await state.sql_store.run_flow(events.head, readonly=True)
    subscriber = await state.broadcaster.subscribe(identity, start)

    async def stream() -> AsyncIterator[str]:
        try:
            yield ": connected\n\n"
            while True:
                # A stream that subscribed while the shutdown began missed the end that run.py sends.
                if state.waker.draining.is_set():
                    return
                try:
                    item = await asyncio.wait_for(subscriber.queue.get(), STREAM_PING_SECONDS)
                except TimeoutError:
                    yield ": ping\n\n"
                    continue
                if item is None or state.waker.draining.is_set():
                    return
                cursor, batch = item
                for i, event in enumerate(batch):
                    shown = events.shown_to(event, identity)
                    # The cursor rides on the batch's last event: resuming from it skips the whole batch.
                    last = f"id: {cursor}\n" if i == len(batch) - 1 else ""
                    yield f"{last}event: {shown['type']}\ndata: {json.dumps(shown, separators=(',', ':'))}\n\n"
        finally:
            state.broadcaster.unsubscribe(subscriber)

    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    let_go = functools.partial(state.broadcaster.unsubscribe, subscriber)
    return _Stream(stream(), media_type="text/event-stream", headers=headers, on_end=let_go)
