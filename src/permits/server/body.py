"""Request bodies as the service reads them: JSON, with every name of an object given once.

RFC 8259 leaves an object whose names repeat to the parser, and Python's keeps the last value:
``{"wants": {"db": 1, "db": 5}}`` would ask for five permits while a reviewer of the request, or a proxy
or log that reads it with another parser, sees one. A lock service should not guess which was meant, so
such a body is refused as JSON it cannot read (422 ``invalid_argument``, field ``body``), on every route,
whether the framework reads the body or the hot routes do (hot.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from permits._exceptions import InvalidArgument

#: the start of the parser's message for a name given twice (errors.py words its answer by it)
NAME_TWICE = "the name "


def _one_value_per_name(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    members = dict(pairs)
    if len(members) != len(pairs):
        names = [name for name, _ in pairs]
        twice = next(name for i, name in enumerate(names) if name in names[:i])
        raise json.JSONDecodeError(f"{NAME_TWICE}{twice!r} appears twice in one object", "", 0)
    return members


_DECODER = json.JSONDecoder(object_pairs_hook=_one_value_per_name)
#: A body that asks nothing: empty, or an empty JSON object (not parsed: any other body is refused unread),
#: of at most this many bytes; a longer one is refused without reading past them.
_NOTHING = re.compile(rb"\s*(\{\s*\})?\s*")
NOTHING_AT_MOST = 64


def loads(body: bytes | str) -> Any:
    """``json.loads``, refusing an object that names a member twice (``json.JSONDecodeError``, which the
    framework answers as a body that is not valid JSON, with this message)."""
    if isinstance(body, bytes | bytearray):
        # As json.loads reads bytes: in the encoding (UTF-8, -16 or -32) their first bytes show.
        body = body.decode(json.detect_encoding(body), "surrogatepass")
    return _DECODER.decode(body)


class _Request(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class Route(APIRoute):
    """The service's routes: their bodies are read with ``loads``, and a route that reads none (a GET, a
    DELETE, whose options go in the query) refuses one rather than drop it unread: a
    ``DELETE /v1/semaphores/s`` sent with ``{"force": true, "reason": "..."}`` was answered as if neither
    had been given."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        takes_a_body = self.body_field is not None

        async def reading_with_loads(request: Request) -> Response:
            if not takes_a_body and _may_have_a_body(request):
                await _refuse_a_body(request)
            return await handle(_Request(request.scope, request.receive))

        return reading_with_loads


def _may_have_a_body(request: Request) -> bool:
    # Only the headers, on the path of every GET: a body comes with a length or in chunks.
    length = request.headers.get("content-length")
    return (length is not None and length.strip() != "0") or "transfer-encoding" in request.headers


async def _refuse_a_body(request: Request) -> None:
    """Refuse the body of a request whose route reads none, after its caller is checked (who may ask is
    answered before what was asked, as for a body that is not JSON). Nothing for an empty body, or an empty
    JSON object, which some HTTP libraries send with every request and which asks nothing."""
    from permits.server.routes import refuse_caller  # routes builds on this module

    # The caller first, and then no more of the body than a body that asks nothing can be: a GET's body has
    # no size limit of its own (app.py's _BodyLimit), and one read whole, before the token was checked, let
    # anyone fill the instance's memory.
    await refuse_caller(request)
    length = request.headers.get("content-length", "").strip()
    if not (length.isdigit() and int(length) > NOTHING_AT_MOST):
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > NOTHING_AT_MOST:
                break
        if len(raw) <= NOTHING_AT_MOST and _NOTHING.fullmatch(raw):
            return
    path = getattr(request.scope.get("route"), "path_format", request.url.path)
    raise InvalidArgument(
        f"{request.method} {path} takes no body, and this one would be dropped unread: give its options in the query",
        field="body",
    )
