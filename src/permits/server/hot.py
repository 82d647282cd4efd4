"""The hot routes: acquire and release, answered in front of the framework.

A lock service spends its life on two requests, ``POST /v1/leases`` and ``POST /v1/leases/release``.
Through FastAPI each one cost the service about a quarter of a millisecond of CPU before its handler ran:
the framework's layers (error handling, telemetry, body limits, our access log), its routing, dependency
resolution, body parsing and response building. That was more than the rest of a request cost once a
semaphore's grants and releases go to the database in turns (docs/benchmarks.md, "The service in
turns"). So these two requests are answered here, in front of every layer, by the routes' own handlers
(``routes.acquire_lease`` and ``routes.release_lease``), with the same checks:

- the caller, through the same ``Authenticator``;
- the body, parsed as the framework parses it (``body.loads``) and validated with the same pydantic model;
- the body limit, and what counts as JSON, as the app's own middleware (``app._BodyLimit``) has them.

It answers only what it can answer exactly as the framework would. A request whose caller is refused, or
whose body is not JSON, too large, sent in chunks, or not valid, goes on to the framework with its body,
and gets the framework's answer (the 401, the 413, the 422 naming the field). So every refusal is the
one documented in docs/bad-input.md, and tests/service/test_hot_routes.py holds the two to the same
answers. The framework's routes stay in the OpenAPI document; a request answered here is logged and
counted under its route like any other. ``hot_routes = false`` sends everything through the framework.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from permits._exceptions import PermitsError
from permits.server import errors, gone, routes, schemas
from permits.server.auth import Identity
from permits.server.body import loads
from permits.server.state import ServiceState

Handler = Callable[[Any, Identity, ServiceState], Awaitable[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class _HotRoute:
    model: type[BaseModel]
    handler: Handler
    status: int
    #: the framework's route for the same path: the access log and the metrics name the request by it
    path: str
    #: a request that waits for room stops when its client goes away (gone.py)
    watches: bool = False


class HotRoutes:
    """Answers ``POST /v1/leases`` and ``POST /v1/leases/release`` (see the module), and hands every other
    request, and every one of those it does not answer, to ``app``: the whole framework app."""

    def __init__(self, app: ASGIApp, fastapi_app: FastAPI, state: ServiceState) -> None:
        self.app = app
        self.state = state
        self.max_body = state.config.limits.max_body_bytes
        posts = errors.leaf_routes(fastapi_app.router.routes)
        found = {r.path for r in posts if isinstance(r, APIRoute) and r.methods == {"POST"}}
        self._routes: dict[str, _HotRoute] = {
            path: _HotRoute(model, handler, status, path, watches)
            for path, model, handler, status, watches in (
                ("/v1/leases", schemas.AcquireIn, routes.acquire_lease, 201, True),
                ("/v1/leases/release", schemas.ReleaseIn, routes.release_lease, 200, False),
            )
        }
        assert set(self._routes) <= found, "the hot routes must be the framework's routes too"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = self._routes.get(scope["path"]) if scope["method"] == "POST" and not scope.get("root_path") else None
        if hot is None:
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        authorization, content_type, length = _headers(scope)
        if length is None or length > self.max_body or not _is_json(content_type):
            await self.app(scope, receive, send)  # the body limit, chunks, and other media types: as it says
            return
        body = await _whole_body(receive)
        if body is None:
            return  # the client went away
        replay = replaying(body, receive)
        try:
            identity = self.state.auth.identify(authorization)
            given = hot.model.model_validate(loads(body))
        except Exception:
            # Refused, but the framework says how, as it would have without the hot routes.
            await self.app(scope, replay, send)
            return
        response: JSONResponse
        try:
            async with gone.watching_if(hot.watches and bool(getattr(given, "wait", None)), receive):
                answer = await hot.handler(given, identity, self.state)
            headers = routes.lease_location(answer, getattr(given, "owner", None)) if hot.status == 201 else None
            response = JSONResponse(answer, status_code=hot.status, headers=headers)
        except PermitsError as exc:
            response = errors.permits_error_response(self.state.metrics, exc)
        except Exception as exc:
            response = errors.unexpected_response(scope["method"], scope["path"], exc)
        response.headers["cache-control"] = "no-store"  # as every /v1 answer (app._AccessLog)
        try:
            await response(scope, replay, send)
        finally:
            self.state.metrics.record_request(scope["method"], hot.path, response.status_code, started, identity.name)


def _headers(scope: Scope) -> tuple[str | None, str | None, int | None]:
    """The request's Authorization, Content-Type and Content-Length (``None``: absent, or not a number)."""
    authorization = content_type = length = None
    for key, value in scope["headers"]:
        name = key.lower()
        if name == b"authorization":
            authorization = authorization if authorization is not None else value.decode("latin-1")
        elif name == b"content-type":
            content_type = content_type if content_type is not None else value.decode("latin-1")
        elif name == b"content-length":
            length = int(value) if value.isdigit() else -1
        elif name == b"transfer-encoding":
            return authorization, content_type, None  # chunked: the body limit reads it
    return authorization, content_type, None if length is None or length < 0 else length


def _is_json(content_type: str | None) -> bool:
    """What the framework reads as JSON here: ``application/json`` or ``application/*+json``, any parameters;
    and a body sent with no type, or as a form (curl -d), which the app's body limit names JSON."""
    if content_type is None:
        return True
    kind = content_type.split(";")[0].strip().lower()
    if kind in ("", "application/x-www-form-urlencoded", "application/json"):
        return True
    return kind.startswith("application/") and kind.endswith("+json")


async def _whole_body(receive: Receive) -> bytes | None:
    """The request's body, read whole (its length is within the limit); ``None`` if the client went away."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body read already, then what the client sends next (its disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
