"""The Python client against a service instance of an older version, behind the same address as a newer
one (a rolling upgrade): the newer one listed ``keep_place`` in its features, the older one refuses the
field it does not know. The client then asks without it, from then on."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

import permits


def test_an_older_instance_that_refuses_keep_place_is_asked_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[dict[str, Any]] = []

    def older_instance(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/whoami":  # answered by the newer instance
            about = {"identity": "x", "admin": False, "version": "new", "limits": {"max_wait": 5.0}}
            return httpx.Response(200, json={**about, "features": ["keep_place"]})
        body = json.loads(request.content)
        asked.append(body)
        if "keep_place" in body:
            details = {"field": "keep_place"}
            error = {"code": "invalid_argument", "message": "keep_place: Extra inputs are not permitted"}
            return httpx.Response(422, json={"error": {**error, "details": details}})
        return httpx.Response(409, json={"error": {"code": "acquire_timeout", "message": "no room", "details": {}}})

    real_client = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: real_client(transport=httpx.MockTransport(older_instance), **kw))
    with permits.connect("http://127.0.0.1:9", owner="o") as client, pytest.raises(permits.AcquireTimeout):
        client.acquire("s", key="k", ttl=30, timeout=0.3)
    assert "keep_place" in asked[0]
    assert all("keep_place" not in body for body in asked[1:]) and len(asked) >= 2
