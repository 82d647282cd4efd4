"""The hot routes (server/hot.py) answer acquire and release without the framework: every answer must be
the one the framework gives. Two real services over databases set up alike, one with the hot routes and
one without (``hot_routes = false``), get the same requests, good and bad, and must answer alike, but for
what differs by nature (times, fencing tokens, generated keys)."""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import permits
from tests._service import Service, running
from tests.conftest import own_database

ADMIN, CLIENT = "admin-token-0123456789", "client-token-0123456789"
TOKENS = [{"name": "ops", "token": ADMIN, "admin": True}, {"name": "app", "token": CLIENT}]
ENV = {
    "PERMITS_MAINTENANCE__ENABLED": "false",
    "PERMITS_LIMITS__MAX_WAIT": "5",
    "PERMITS_LIMITS__MAX_BODY_BYTES": "2048",
    "PERMITS_LIMITS__MAX_LEASES_PER_CLIENT": "50",
}
#: What differs between two services by nature, not by how they answer.
_VARYING = ("acquired_at", "expires_at", "expires_in", "ended_at")


@contextlib.contextmanager
def _database(backend: str, folder: Path, label: str) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{folder / label}.db"
        return
    with own_database(backend, f"permits_hot_{label}") as url:
        with permits.connect(url, auto_upgrade=True) as client:
            client.list_semaphores()  # creates the schema
        yield url


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Service]]:
    """On SQLite the lines ask one request at a time, on PostgreSQL they work in turns: both take part."""
    backend, folder = str(request.param), tmp_path_factory.mktemp("hot")
    with (
        _database(backend, folder, "on") as on,
        _database(backend, folder, "off") as off,
        running(on, tokens=TOKENS, env=ENV) as hot,
        running(off, tokens=TOKENS, env={**ENV, "PERMITS_HOT_ROUTES": "false"}) as plain,
    ):
        for service in (hot, plain):
            for name, capacity in (("db", 2), ("other", 1)):
                body = {"name": name, "capacity": capacity}
                answer = httpx.post(f"{service.url}/v1/semaphores", json=body, headers=_auth(ADMIN), timeout=10)
                assert answer.status_code == 201, answer.text
        yield hot, plain


def _auth(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def _normal(body: Any) -> Any:
    """An answer with what varies by nature taken out."""
    if isinstance(body, dict):
        return {k: ("*" if k in _VARYING and v is not None else _normal(v)) for k, v in body.items()}
    if isinstance(body, list):
        return [_normal(v) for v in body]
    return body


def _send(service: Service, path: str, *, token: str | None = CLIENT, **request: Any) -> tuple[Any, ...]:
    headers = {**_auth(token), **request.pop("headers", {})}
    answer = httpx.post(f"{service.url}{path}", headers=headers, timeout=30, **request)
    kind = answer.headers.get("content-type", "")
    body = answer.json() if kind.startswith("application/json") else answer.text
    said = tuple(answer.headers.get(h, "") for h in ("retry-after", "location", "www-authenticate"))
    return answer.status_code, _normal(body), said


KEY = uuid.uuid4().hex
#: (path, request, token): each is sent to both services in this order, so that their states stay alike.
CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("/v1/leases", {"json": {"wants": {"db": 1}, "key": KEY, "ttl": 30}}, CLIENT),
    ("/v1/leases", {"json": {"wants": {"db": 1}, "key": KEY, "ttl": 30}}, CLIENT),  # a retry: the same lease
    ("/v1/leases", {"json": {"wants": {"db": 2}, "key": KEY}}, CLIENT),  # the key, for another request
    ("/v1/leases", {"json": {"wants": [{"name": "other", "count": 1}], "key": "k2", "owner": "w"}}, CLIENT),
    ("/v1/leases", {"json": {"wants": {"other": 1}, "key": "k3"}}, CLIENT),  # no room, no wait
    ("/v1/leases", {"json": {"wants": {"other": 1}, "key": "k4", "wait": 0.2}}, CLIENT),  # no room in the wait
    ("/v1/leases", {"json": {"wants": {"nothing": 1}, "key": "k5"}}, CLIENT),
    ("/v1/leases", {"json": {"wants": {"db": 3}, "key": "k6"}}, CLIENT),  # more than the capacity
    ("/v1/leases", {"json": {"wants": {"db": 1}, "wait": 60}}, CLIENT),  # past the service's bound
    ("/v1/leases", {"json": {"wants": {"db": 1}, "ttl": -1}}, CLIENT),
    ("/v1/leases", {"json": {"wants": {"db": 1}, "extra": 1}}, CLIENT),
    ("/v1/leases", {"json": {"wants": {"db": "1"}}}, CLIENT),
    ("/v1/leases", {"json": {"wants": {}}}, CLIENT),
    ("/v1/leases", {"json": ["db"]}, CLIENT),
    ("/v1/leases", {"json": None}, CLIENT),
    ("/v1/leases", {"content": b""}, CLIENT),
    ("/v1/leases", {"content": b'{"wants": {"db": 1}'}, CLIENT),
    ("/v1/leases", {"content": b'{"wants": {"db": 1}, "key": "nan", "ttl": NaN}'}, CLIENT),
    ("/v1/leases", {"content": b'{"wants": {"db": 1}, "key": "k7", "key": "k8"}'}, CLIENT),  # the last one
    ("/v1/leases", {"content": b'{"wants": {"db": 1}}', "headers": {"content-type": "text/plain"}}, CLIENT),
    ("/v1/leases", {"data": {"wants": "db"}}, CLIENT),  # a form
    ("/v1/leases", {"content": b'{"wants": {"db": 1}, "key": "k9"}', "headers": {"content-type": "x"}}, CLIENT),
    ("/v1/leases", {"content": b'{"wants": {"db": 1}, "key": "k10"}'}, CLIENT),  # no type: read as JSON
    ("/v1/leases", {"json": {"wants": {"db": 1}, "pad": "x" * 3000}}, CLIENT),  # over the body limit
    ("/v1/leases", {"json": {"wants": {"db": 1}}}, None),
    ("/v1/leases", {"json": {"wants": {"db": 1}}}, "wrong-token-0123456789"),
    ("/v1/leases", {"json": {"wants": {"db": 1}, "owner": "x" * 300}}, CLIENT),
    ("/v1/leases/release", {"json": {"key": KEY}}, CLIENT),
    ("/v1/leases/release", {"json": {"key": KEY}}, CLIENT),
    ("/v1/leases/release", {"json": {"key": "k2", "owner": "w"}}, CLIENT),
    ("/v1/leases/release", {"json": {"key": "never"}}, CLIENT),
    ("/v1/leases/release", {"json": {"key": KEY}}, ADMIN),  # another identity: not its lease
    ("/v1/leases/release", {"json": {}}, CLIENT),
    ("/v1/leases/release", {"json": {"key": ""}}, CLIENT),
    ("/v1/leases/release", {"json": {"key": "a\u0000b"}}, CLIENT),
    ("/v1/leases/release", {"content": b"{"}, CLIENT),
    ("/v1/leases/release", {"json": {"key": KEY}}, None),
]


def test_the_hot_routes_answer_as_the_framework_does(pair: tuple[Service, Service]) -> None:
    hot, plain = pair
    for path, request, token in CASES:
        answers = [_send(service, path, token=token, **dict(request)) for service in (hot, plain)]
        assert answers[0] == answers[1], (path, request, token)


def test_the_hot_routes_are_logged_and_counted_as_routes(pair: tuple[Service, Service]) -> None:
    hot, _ = pair
    assert _send(hot, "/v1/leases", json={"wants": {"db": 1}, "key": "counted"})[0] == 201
    assert _send(hot, "/v1/leases/release", json={"key": "counted"})[0] == 200
    metrics = httpx.get(f"{hot.url}/metrics", headers=_auth(ADMIN), timeout=10).text
    for route, status in (("/v1/leases", "201"), ("/v1/leases/release", "200")):
        found = re.search(rf'permits_http_requests_total{{route="{route}",status="{status}"}} (\d+)', metrics)
        assert found and int(found.group(1)) >= 1, metrics
    assert re.search(r'permits_acquire_total{outcome="granted"} [1-9]', metrics)


def test_the_path_in_docs_is_the_same(pair: tuple[Service, Service]) -> None:
    """The routes the hot path answers are still in the API's document, as the framework states them."""
    hot, plain = pair
    documents = [httpx.get(f"{s.url}/openapi.json", timeout=10).json()["paths"] for s in (hot, plain)]
    assert documents[0] == documents[1]
    assert {"/v1/leases", "/v1/leases/release"} <= set(documents[0])


def test_a_grant_and_a_creation_say_where_to_read_them(pair: tuple[Service, Service]) -> None:
    """201 comes with a ``Location`` that a ``GET`` reads the new lease or semaphore at: with the owner the
    client named, or none, and the key percent-encoded, ``/`` included."""
    for service in pair:
        with httpx.Client(base_url=service.url, timeout=30) as http:
            made = http.post("/v1/semaphores", json={"name": "team/loc", "capacity": 5}, headers=_auth(ADMIN))
            assert made.headers["Location"] == "/v1/semaphores/team%2Floc"
            assert http.get(made.headers["Location"], headers=_auth(CLIENT)).json()["name"] == "team/loc"
            for asked in ({"key": "a/b c"}, {"key": "d?e", "owner": "w/1"}, {}):
                granted = http.post("/v1/leases", json={"wants": {"team/loc": 1}, **asked}, headers=_auth(CLIENT))
                assert granted.status_code == 201, granted.text
                where = granted.headers["Location"]
                assert where.startswith("/v1/leases/") and "/" not in where[len("/v1/leases/") :]
                read = http.get(where, headers=_auth(CLIENT))
                assert read.status_code == 200, (where, read.text)
                assert read.json()["key"] == granted.json()["key"] and read.json()["held"] is True
                assert read.json()["owner"] == granted.json()["owner"]
                http.post(
                    "/v1/leases/release",
                    json={"key": granted.json()["key"], **({"owner": asked["owner"]} if "owner" in asked else {})},
                    headers=_auth(CLIENT),
                )
