"""Request bodies as the service reads them: JSON, with every name of an object given once.

RFC 8259 leaves an object whose names repeat to the parser, and Python's keeps the last value:
``{"wants": {"db": 1, "db": 5}}`` would ask for five permits while a reviewer of the request, or a proxy
or log that reads it with another parser, sees one. A lock service should not guess which was meant, so
such a body is refused as JSON it cannot read (422 ``invalid_argument``, field ``body``), on every route,
whether the framework reads the body or the hot routes do (hot.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

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
    """The service's routes: their bodies are read with ``loads``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def reading_with_loads(request: Request) -> Response:
            return await handle(_Request(request.scope, request.receive))

        return reading_with_loads
