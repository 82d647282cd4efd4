"""The hot routes: acquire and release, answered without the framework's routing and dependency machinery.

A lock service spends its life on two requests, ``POST /v1/leases`` and ``POST /v1/leases/release``. Through
FastAPI each one cost about a quarter of a millisecond of the service's CPU before the handler ran (its
routing, dependency resolution, body parsing and response building), more than everything else a cycle
costs the service once grants are batched (docs/benchmarks.md, "The hot routes"). This middleware answers
those two requests itself, calling the same handlers as the routes (``routes.acquire_lease`` and
``routes.release_lease``) with the same checks:

- the caller through the same ``Authenticator``;
- the body parsed as FastAPI parses it (``json.loads``) and validated with the same pydantic model.

It answers only what it can answer exactly as the framework would: a request whose caller is refused, or
whose body is not JSON, or not valid, goes on to the framework with its body, and gets the framework's
answer (the 401, the 422 naming the field). So every refusal is the one documented in docs/bad-input.md,
and the framework's routes stay in the OpenAPI document. The request is recorded in the access log and
the metrics under the route it stands for, like any other.

It sits inside the access log and the body limit (``app.py``), which have already refused a body over the
limit and told a body that is not JSON apart.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from permits._exceptions import PermitsError
from permits.server import errors, routes, schemas
from permits.server.auth import Identity
from permits.server.state import ServiceState

Handler = Callable[[Any, Identity, ServiceState], Awaitable[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class _HotRoute:
    model: type[BaseModel]
    handler: Handler
    status: int
    #: the framework's route for the same path: the access log and the metrics name the request by it
    route: APIRoute


class HotRoutes:
    """ASGI middleware that answers ``POST /v1/leases`` and ``POST /v1/leases/release`` (see the module)."""

    def __init__(self, app: ASGIApp, fastapi_app: FastAPI, state: ServiceState) -> None:
        self.app = app
        self.state = state
        posts = errors.leaf_routes(fastapi_app.router.routes)
        found = {r.path: r for r in posts if isinstance(r, APIRoute) and r.methods == {"POST"}}
        self._routes: dict[str, _HotRoute] = {
            "/v1/leases": _HotRoute(schemas.AcquireIn, routes.acquire_lease, 201, found["/v1/leases"]),
            "/v1/leases/release": _HotRoute(schemas.LeaseRefIn, routes.release_lease, 200, found["/v1/leases/release"]),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = self._routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if hot is None or routes.WRONG_BODY_TYPE in scope.get("state", ()) or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        body = await _whole_body(receive)
        if body is None:
            return  # the client went away
        replay = _replaying(body, receive)
        try:
            identity = self.state.auth.identify(_header(scope, b"authorization"))
            if not _is_json(_header(scope, b"content-type")):
                raise ValueError("not JSON")
            given = hot.model.model_validate(json.loads(body))
        except Exception:
            # Refused, but the framework says how, as it would have without this middleware.
            await self.app(scope, replay, send)
            return
        scope["route"] = hot.route
        scope.setdefault("state", {})["identity"] = identity
        response: JSONResponse
        try:
            response = JSONResponse(await hot.handler(given, identity, self.state), status_code=hot.status)
        except PermitsError as exc:
            response = errors.permits_error_response(self.state.metrics, exc)
        except Exception as exc:
            response = errors.unexpected_response(scope["method"], scope["path"], exc)
        await response(scope, replay, send)


async def _whole_body(receive: Receive) -> bytes | None:
    """The request's body, read whole (the body limit has bounded it); ``None`` if the client went away."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body read already, then what the client sends next (its disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def _is_json(content_type: str | None) -> bool:
    """What the framework parses as JSON: ``application/json`` or ``application/*+json``, any parameters.
    (The body limit has already named a body sent with no type, or as a form, JSON.)"""
    if content_type is None:
        return False
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))
