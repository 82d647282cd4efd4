"""Assembles the service: ``create_app(config)`` returns the ASGI app that ``permits serve`` runs."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import permits
from permits._exceptions import InvalidArgument, PermitsError, RequestTooLarge, ServiceUnavailable
from permits.server import auth, body, dashboard, errors, reference, routes, schemas, stats
from permits.server.config import ServerConfig
from permits.server.hot import HotRoutes, replaying
from permits.server.maintenance import LivenessProbe, Maintainer
from permits.server.metrics import Metrics
from permits.server.state import ServiceState

logger = logging.getLogger("permits.server")
#: Seconds between refreshes of the per-semaphore gauges.
GAUGE_REFRESH_SECONDS = 5.0
#: The timeout of readiness's ping: over a link that hangs it answers 503 soon after (within the store's
#: least reply time, 15 s with the default lock wait), where it waited out every attempt's reply deadline and
#: the store's retries, and a load balancer's probes piled up on the instance meanwhile.
READY_TIMEOUT_SECONDS = 2.0


def create_app(
    config: ServerConfig | None = None,
    *,
    metrics: Metrics | None = None,
    liveness: dict[str, LivenessProbe] | None = None,
) -> FastAPI:
    """The service as an ASGI app. ``liveness`` maps owner prefixes to Python liveness checks (see
    ``permits.server.maintenance``); checks by HTTP callback come from the config."""
    config = config or ServerConfig.load()
    state = ServiceState.build(config, metrics, liveness)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.client.__aenter__()  # checks (or, on SQLite, creates) the schema before serving
        background = [asyncio.create_task(_refresh_gauges(state), name="permits-gauges")]
        if config.dashboard.enabled:
            background.append(asyncio.create_task(stats.write_instance_stats(state), name="permits-stats"))
        maintainer = Maintainer(state) if config.maintenance.enabled else None
        if maintainer is not None:
            background += maintainer.start()
        mode = "open mode: no tokens, loopback only" if config.open_mode else f"{len(config.tokens)} token(s)"
        logger.info("permits %s serving %s (%s)", permits.__version__, state.sql_store.url, mode)
        try:
            yield
        finally:
            state.waker.draining.set()  # answer anyone still waiting for room
            await state.broadcaster.close()  # any stream still open (run.py ends them at the signal)
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await state.client.aclose()

    app = _Service(
        title="permits",
        version=permits.__version__,
        summary="Distributed counting semaphores, mutexes and leases on a SQL database.",
        description=_API_DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # reference.py serves both pages without a CDN
        redoc_url=None,
    )
    # The app's own routes (/healthz, /readyz, /metrics, the API reference) refuse a body too, as the API's
    # do, rather than drop it unread.
    app.router.route_class = body.Route
    app.state.permits = state
    _document_limits(app, config)
    errors.install(app)
    app.include_router(routes.router)
    reference.install(app)
    if config.dashboard.enabled:
        app.include_router(dashboard.router)
    else:

        @app.get("/", include_in_schema=False)
        async def index() -> Response:
            return HTMLResponse(_NO_DASHBOARD)

    app.add_middleware(_Head)
    app.add_middleware(_BodyLimit, max_bytes=config.limits.max_body_bytes)

    app.add_middleware(_AccessLog, metrics=state.metrics)

    # 422 on these too: the URL's check (_url_problem) refuses a query parameter given twice on every path.
    @app.get("/healthz", tags=["service"], responses=schemas.error_responses(422))
    async def healthz() -> dict[str, str]:
        """The process is up (liveness)."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["service"], responses=schemas.error_responses(422, 503))
    async def readyz() -> JSONResponse:
        """The database answers and the instance is not shutting down (readiness)."""
        if state.waker.draining.is_set():
            # An error body like every other refusal: a client's ping() raises ServiceUnavailable, not a
            # generic error (nor takes the 503 for a proxy's).
            return errors.error_response(ServiceUnavailable("this instance is shutting down", limit="shutdown"))
        try:
            await state.client.ping(timeout=READY_TIMEOUT_SECONDS)
        except PermitsError as exc:
            # Whatever failed (the database refused the probe's read, say), the instance cannot serve: a 503,
            # which is what a probe reads as "not ready", with the error's own code; never a 500.
            return errors.error_response(exc, status=503)
        return JSONResponse({"status": "ready"})

    @app.get(
        "/metrics",
        tags=["service"],
        response_class=PlainTextResponse,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            # Spelt out: with "model", the route's own media type (text/plain) would be stated for it.
            401: {
                "description": "no token, or an unknown one (not in open mode)",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}},
            },
            422: {
                "description": "a query parameter given twice, a URL that is not UTF-8, or a body (it reads none)",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}},
            },
        },
    )
    async def metrics_endpoint(_caller: routes.Caller) -> Response:
        """Prometheus metrics. They name semaphores, so they need a token like the API (a scraper sends
        one with ``authorization``), except in open mode."""
        # The caller is checked as a dependency, as the API's are: first, before a body is refused.
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if config.hot_routes:
        app.hot = HotRoutes(functools.partial(FastAPI.__call__, app), app, state)
    return app


class _Service(FastAPI):
    """The service's app: FastAPI, with the hot routes in front of it (hot.py), where they answer a request
    before any of the framework's layers, or hand it on."""

    hot: HotRoutes | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        bad = _url_problem(scope) if scope["type"] == "http" else None
        if bad is not None:
            # Refused before routing, so before the access log's middleware: logged and counted here.
            started = time.monotonic()
            refusal = errors.error_response(bad)
            refusal.headers["cache-control"] = "no-store"
            try:
                await refusal(scope, receive, send)
            finally:  # counted even when its client has gone
                metrics = self.state.permits.metrics
                metrics.record_request(scope["method"], "unmatched", refusal.status_code, started, None)
            return
        if self.hot is not None and scope["type"] == "http":
            await self.hot(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def _url_problem(scope: Scope) -> InvalidArgument | None:
    """What makes a request's URL unreadable as one request, before it is routed: a path that is not
    UTF-8 text (the framework decodes it with U+FFFD, so "%ff" would name the semaphore "\ufffd", and a
    DELETE act on it), or a query with such a value or a parameter given twice (``_query_problem``)."""
    if not _path_is_text(scope):
        return InvalidArgument("the path is not percent-encoded UTF-8 text", field="path")
    query = scope.get("query_string")
    return _query_problem(query) if query else None


def _path_is_text(scope: Scope) -> bool:
    raw = scope.get("raw_path")
    if not raw or b"%" not in raw:
        return True  # the server decoded plain bytes as ASCII or failed it already
    try:
        urllib.parse.unquote_to_bytes(raw.split(b"?", 1)[0]).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _query_problem(query: bytes) -> InvalidArgument | None:
    """What is wrong with a query string, as a body's faults are: a value that is not UTF-8 text (the
    framework would read ``?prefix=%ff`` as U+FFFD and list nothing), or a parameter given twice
    (``?force=false&force=true``: the framework keeps the last, and a reader of the URL may see the first,
    as with a JSON name given twice)."""
    seen: set[str] = set()
    for part in query.split(b"&"):
        if not part:
            continue
        raw_name, _, raw_value = part.partition(b"=")
        try:
            name = urllib.parse.unquote_to_bytes(raw_name.replace(b"+", b" ")).decode("utf-8")
        except UnicodeDecodeError:
            return InvalidArgument("the query is not percent-encoded UTF-8 text", field="query")
        try:
            urllib.parse.unquote_to_bytes(raw_value.replace(b"+", b" ")).decode("utf-8")
        except UnicodeDecodeError:
            return InvalidArgument(f"the query's {name!r} is not percent-encoded UTF-8 text", field=name)
        if name in seen:
            return InvalidArgument(f"the query gives {name!r} more than once: give it once", field=name)
        seen.add(name)
    return None


def _document_limits(app: FastAPI, config: ServerConfig) -> None:
    """The OpenAPI document states this instance's limits (built once, on the first request for it)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            limits = config.limits
            max_owner = None if config.open_mode else auth.SCOPED_OWNER_LENGTH
            schemas.state_limits(build(), limits.max_wants, limits.max_ttl, limits.max_wait, max_owner)
            if not config.open_mode:
                schemas.state_security(app.openapi_schema)  # type: ignore[arg-type]
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


async def _refresh_gauges(state: ServiceState) -> None:
    limit = state.config.metrics_max_semaphores
    while True:
        with contextlib.suppress(PermitsError):
            semaphores = await state.client.list_semaphores()
            gauges = state.metrics.semaphores
            gauges.total = len(semaphores)
            gauges.snapshot = semaphores[:limit]
            gauges.leases = await state.sql_store.leases_per_semaphore() if limit else {}
        await asyncio.sleep(GAUGE_REFRESH_SECONDS)


_NO_DASHBOARD = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>permits</title></head><body><main>
<h1>permits</h1><p>The dashboard is switched off on this instance (<code>dashboard.enabled</code>).
The API is at <a href="/docs">/docs</a>.</p></main></body></html>
"""


#: The answers that say how things are now, never to be stored by a cache (the dashboard's page and its
#: scripts, under / and /ui/, may be).
_LIVE_PATHS = ("/v1/", "/healthz", "/readyz", "/metrics")


class _AccessLog:
    """Logs and counts every request: route, status, duration and the caller's identity. A plain ASGI
    middleware: Starlette's BaseHTTPMiddleware costs a task and a stream per request."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500
        live = scope["path"].removeprefix(scope.get("root_path", "")).startswith(_LIVE_PATHS)

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = message.get("headers", [])
                if live and not any(name.lower() == b"cache-control" for name, _ in headers):
                    # Who holds what, and whether the instance is up, are true only now: a cache between a
                    # caller and the service (a CDN, a corporate proxy, a browser's back button) must not
                    # answer a later GET with them (RFC 9111 lets it store a 200 with no header at all).
                    message = {**message, "headers": [*headers, (b"cache-control", b"no-store")]}
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            identity = getattr(scope.get("state", {}).get("identity"), "name", None)
            self.metrics.record_request(scope["method"], route, status, started, identity)


class _Head:
    """HEAD wherever GET is, as HTTP asks of every server (RFC 9110, 9.3.2): a load balancer's check, a
    monitor or ``curl -I`` gets the GET's status and headers, Content-Length included, and no body.

    The app answers a GET; its body is dropped (the server, which knows the request was a HEAD, sends
    none). An event stream never ends by itself, so once it sends its first part the app is cancelled, as
    a GET's is when its client goes away. Done here rather than as HEAD routes: those would double every
    GET in the OpenAPI document."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] != "HEAD":
            await self.app(scope, receive, _allowing_head(send))
            return
        scope.setdefault("state", {})  # shared with the copy: the access log finds the caller's identity there
        as_get = {**scope, "method": "GET"}
        streaming = asyncio.Event()

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.start":
                await _allowing_head(send)(message)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            elif message["type"] == "http.response.body" and message.get("more_body", False):
                streaming.set()  # a body in parts, perhaps without end: nothing of it is sent

        answering = asyncio.ensure_future(self.app(as_get, receive, headers_only))
        stream_began = asyncio.ensure_future(streaming.wait())
        try:
            await asyncio.wait((answering, stream_began), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stream_began.cancel()
            if not answering.done():
                answering.cancel()
                await asyncio.wait((answering,))  # its clean-up (a stream's subscription) runs before we return
            elif not answering.cancelled():
                answering.exception()  # retrieved: never reported as unretrieved if this request is cancelled
            if "route" in as_get:  # the access log and the metrics name the request by its route
                scope["route"] = as_get["route"]
        if not answering.cancelled():
            answering.result()  # the app's own error, if it raised one


def _allowing_head(send: Send) -> Send:
    """A 405's ``Allow`` lists HEAD where it lists GET (the routes name GET only; ``_Head`` serves HEAD)."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] == 405:
            headers = [
                (name, value + b", HEAD" if name.lower() == b"allow" and _lists_get_alone(value) else value)
                for name, value in message.get("headers", [])
            ]
            message = {**message, "headers": headers}
        await send(message)

    return sending


def _lists_get_alone(allow: bytes) -> bool:
    methods = [method.strip() for method in allow.split(b",")]
    return b"GET" in methods and b"HEAD" not in methods


class _BodyLimit:
    """Reads every request body as JSON, and refuses one over ``max_bytes`` with 413: by its
    Content-Length, or for a chunked body as soon as it grows past the bound (read here, before the app:
    the framework turns any error raised while it reads a body into 'cannot parse')."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if not kind or kind == b"application/x-www-form-urlencoded":
            # Every body this API takes is JSON: read one sent as a form (curl -d's default) or with no
            # Content-Type as JSON too. In place, not a copy: the outer middleware reads what the router
            # records in the scope.
            others = [(n, v) for n, v in scope.get("headers", []) if n != b"content-type"]
            scope["headers"] = [*others, (b"content-type", b"application/json")]
        elif kind != b"application/json" and not kind.endswith(b"+json") and _has_body(headers):
            # Refused by the route, once it is known to exist and the caller to be let in (routes.py
            # WRONG_BODY_TYPE): an unknown path is still a 404, and a caller with no token a 401.
            scope.setdefault("state", {})[routes.WRONG_BODY_TYPE] = kind.decode("latin-1")[:100]
        too_large = RequestTooLarge(f"request bodies are at most {self.max_bytes} bytes", limit="max_body_bytes")
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                await errors.error_response(too_large)(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # Chunked: read it whole here (it is small, or refused), then hand it on.
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                await errors.error_response(too_large)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, replaying(b"".join(parts), receive), send)


_BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")


def _has_body(headers: dict[bytes, bytes]) -> bool:
    return headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers


class JSONLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any structured fields."""

    _STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in self._STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


_API_DESCRIPTION = """
Counting semaphores, mutexes and leases whose source of truth is a SQL database.

* Authenticate with `Authorization: Bearer <token>` (not needed in open mode, on loopback).
* Errors are `{"error": {"code", "message", "details"}}`; `code` is stable (see docs/service.md).
* Fencing tokens are decimal strings: exact up to 2^63-1 in every language.
* 503 and 429 answers carry `Retry-After`; retry an acquire with the same `key`, it never grants twice.
"""
