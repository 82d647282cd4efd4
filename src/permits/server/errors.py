"""Error codes to HTTP statuses, and the one JSON error body.

Every error the service sends is ``{"error": {"code": ..., "message": ..., "details": {...}}}`` where
``code`` is the stable code of a ``PermitsError`` class; the remote client raises that same class. No
body ever carries a stack trace, SQL or a database URL: storage errors get a fixed message, and anything
unexpected is logged here and answered with a bare 500.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from permits._exceptions import (
    AcquireTimeout,
    ConfigurationError,
    CountExceedsCapacity,
    Forbidden,
    IdempotencyConflict,
    InvalidArgument,
    LeaseError,
    LeaseLost,
    LeaseNotFound,
    LimitExceeded,
    PermitsError,
    RequestTooLarge,
    SchemaMismatch,
    SemaphoreExists,
    SemaphoreInUse,
    SemaphoreNotFound,
    ServiceError,
    ServiceUnavailable,
    StorageConflict,
    StorageError,
    StorageReadOnly,
    StorageUnavailable,
    Unauthorized,
    UsageError,
)
from permits.server import body, routes, schemas
from permits.server.metrics import Metrics
from permits.server.schemas import TAGGED_FIELDS

logger = logging.getLogger("permits.server")

#: The status for each error class; a subclass not listed takes its nearest listed base's.
STATUS: dict[type[PermitsError], int] = {
    InvalidArgument: 422,
    CountExceedsCapacity: 422,
    ConfigurationError: 500,
    SemaphoreNotFound: 404,
    SemaphoreExists: 409,
    SemaphoreInUse: 409,
    AcquireTimeout: 409,  # no room within the wait: a conflict with the current state, not a server fault
    IdempotencyConflict: 409,
    LeaseError: 409,
    LeaseNotFound: 404,
    LeaseLost: 410,
    StorageError: 500,
    StorageUnavailable: 503,
    StorageConflict: 503,
    StorageReadOnly: 503,
    SchemaMismatch: 503,
    UsageError: 400,
    ServiceError: 500,
    Unauthorized: 401,
    Forbidden: 403,
    RequestTooLarge: 413,
    LimitExceeded: 429,
    ServiceUnavailable: 503,
    PermitsError: 500,
}

#: Storage errors are answered with these words only: the library's own messages name the database.
_STORAGE_MESSAGES: dict[str, str] = {
    StorageUnavailable.code: "the database is unavailable; try again shortly",
    StorageConflict.code: "the database kept reporting lock conflicts; try again shortly",
    StorageReadOnly.code: "the service's database refused a write: it is a read-only replica",
    SchemaMismatch.code: (
        "the service's database schema does not match this version of permits: upgrade the schema"
        " (`permits db upgrade`) or permits, as the service log says"
    ),
    StorageError.code: "the database failed; see the service log",
}


def status_for(error: PermitsError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details or {}}}


def error_response(error: PermitsError, *, status: int | None = None) -> JSONResponse:
    """The answer to a refused request: the error's own status, or ``status`` where a route says otherwise."""
    status = status_for(error) if status is None else status
    if isinstance(error, StorageError):
        logger.warning("storage error: %s: %s", error.code, error.message)
        body = error_body(error.code, _STORAGE_MESSAGES.get(error.code, _STORAGE_MESSAGES[StorageError.code]))
    else:
        body = error_body(error.code, error.message, _json_safe(error.details))
    headers = {"Retry-After": str(schemas.RETRY_AFTER_SECONDS)} if status in (429, 503) else None
    if isinstance(error, Unauthorized):
        # RFC 9110 (11.6.1) and RFC 6750: a 401 names the scheme it wants.
        headers = {"WWW-Authenticate": 'Bearer realm="permits"'}
    return JSONResponse(body, status_code=status, headers=headers)


def _json_safe(details: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, str | int | float | bool | type(None)) else str(v) for k, v in details.items()}


def _allowed_methods(request: Request) -> str:
    methods: set[str] = set()
    for route in leaf_routes(request.app.router.routes):
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def _no_route_message(request: Request, status: int) -> str:
    """What a 404 or 405 from routing says: the method and path it refused, and, for a path that ends in a
    slash, the path without it where that takes the method. ``POST /v1/semaphores/`` reaches the route of
    one semaphore, whose empty name takes no POST: a bare "Method Not Allowed" sent its reader looking for
    a method, where the slash was the mistake."""
    method, path = request.method, request.url.path
    refused = f"{method} {path}: " + ("no such endpoint" if status == 404 else "the endpoint takes no " + method)
    if len(path) > 1 and path.endswith("/"):
        # Only the path changes: root_path, the method and the rest of the scope stay the request's own.
        bare = {**request.scope, "path": request.scope["path"].rstrip("/") or "/"}
        for route in leaf_routes(request.app.router.routes):
            if route.matches(bare)[0] is Match.FULL:
                return f"{refused}; without the trailing slash, {method} {path.rstrip('/') or '/'} is one"
    return f"{refused} (the API is described at /openapi.json)"


def leaf_routes(routes: list[Any]) -> Iterator[Any]:
    """The routes that answer requests, inside the routers the app includes (FastAPI keeps an included
    router whole, as ``original_router``) and inside mounts."""
    for route in routes:
        if hasattr(route, "methods"):
            yield route
        else:  # an included router, which FastAPI keeps whole as ``original_router``, or a mount
            inner = getattr(route, "original_router", route)
            yield from leaf_routes(list(getattr(inner, "routes", [])))


def _location(loc: Any) -> list[str]:
    """A validation error's location as the client wrote the request: without where it was (body, query,
    path) and without the tag of the form a value took (``schemas.TAGGED_FIELDS``)."""
    # "[key]" marks an error in a map's key rather than its value: the key is named all the same.
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "[key]")]
    if len(parts) > 1 and parts[0] in TAGGED_FIELDS:
        del parts[1]
    return parts


async def _unparsed_body(request: Request, why: str) -> JSONResponse:
    """A body the framework could not parse. It parses before any dependency runs, so the caller is told
    first what the route would have told it (401, 403), as for every other bad input."""
    try:
        await routes.refuse_caller(request)
    except PermitsError as refused:
        return error_response(refused)
    if why.startswith(body.NAME_TWICE):  # valid JSON, which parsers read differently: ambiguous, not broken
        return error_response(InvalidArgument(f"the body is ambiguous: {why}", field="body"))
    return error_response(InvalidArgument(f"the body is not valid JSON ({why})", field="body"))


def permits_error_response(metrics: Metrics, exc: PermitsError) -> JSONResponse:
    """The answer to a request that failed with one of permits' errors (storage errors are counted)."""
    if isinstance(exc, StorageError):
        metrics.storage_errors.labels(exc.code).inc()
    return error_response(exc)


def unexpected_response(method: str, path: str, exc: Exception) -> JSONResponse:
    """The answer to a request that failed unexpectedly: a bare 500 naming an incident that the log explains."""
    incident = uuid.uuid4().hex[:12]
    logger.error("unexpected error (incident %s) on %s %s", incident, method, path, exc_info=exc)
    body = error_body("internal_error", f"internal error; the service log has incident {incident}")
    return JSONResponse(body, status_code=500)


def install(app: FastAPI) -> None:
    @app.exception_handler(PermitsError)
    async def _permits_error(request: Request, exc: PermitsError) -> JSONResponse:
        return permits_error_response(request.app.state.permits.metrics, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":  # loc is ("body", offset): the body, not a field "0"
            # The parser's own words ("Expecting value", a name given twice) say more than the framework's.
            context = first.get("ctx")
            why = context.get("error") if isinstance(context, dict) else None
            return await _unparsed_body(request, str(why or first.get("msg")))
        loc = _location(first.get("loc", ()))
        field = loc[0] if loc else "body"
        # A name that is empty or holds a dot is quoted, so that the path reads unambiguously.
        where = ".".join(p if p and "." not in p else json.dumps(p) for p in loc) or "the body"
        return error_response(InvalidArgument(f"{where}: {first.get('msg', 'invalid')}", field=field))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # the framework could not parse the body: bad input like any other
            return await _unparsed_body(request, str(exc.detail))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "service_error")
        headers = exc.headers
        message = str(exc.detail)
        if exc.status_code in (404, 405) and message == HTTPStatus(exc.status_code).phrase:  # routing's own
            message = _no_route_message(request, exc.status_code)
        if exc.status_code == 405:
            # RFC 9110: a 405 lists in Allow every method the path takes. Starlette's own lists only those
            # of the first route that matched the path, and a path here often has a route per method.
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return JSONResponse(error_body(code, message), status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return unexpected_response(request.method, request.url.path, exc)
