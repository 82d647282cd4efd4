"""A waiting request whose client goes away stops waiting (permits/server/gone.py): it is not granted
afterwards, so no lease is left held, until its TTL, for a client that will never read it. A real service
process, with its hot routes and without them; the client is a plain socket that closes its connection."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

import permits
from tests._service import Service, metric, module_db_url, running, wait_until

pytestmark = pytest.mark.usefixtures("servers")


@pytest.fixture(scope="module", params=["sqlite-hot", "mysql-hot", "postgresql-hot", "postgresql-framework"])
def service(
    request: pytest.FixtureRequest, servers: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    backend, routes = str(request.param).split("-")
    url = module_db_url(backend, servers, tmp_path_factory, "gone")
    env = {"PERMITS_MAINTENANCE__ENABLED": "false", "PERMITS_HOT_ROUTES": str(routes == "hot").lower()}
    with running(url, env=env) as svc:
        yield svc


def _ask_and_leave(service: Service, body: dict[str, Any], waiting: Callable[[], bool] | None = None) -> None:
    """Send an acquire, and close the connection without reading the answer once the service has the
    request waiting (on a loaded machine it may take a while to read it): once ``waiting()``, by default
    once this instance counts one more request waiting for room (a fair queue's waiters on PostgreSQL wait
    for the database's call instead, and are not counted there)."""
    host, port = service.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    before = metric(service, "permits_waiters") or 0.0
    waiting = waiting or (lambda: (metric(service, "permits_waiters") or 0.0) > before)
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        assert wait_until(waiting, timeout=20)
        time.sleep(0.3)


def _gone_count(service: Service) -> float:
    return metric(service, 'permits_acquire_total{outcome="gone"}') or 0.0


@pytest.mark.parametrize("shape", ["one", "two", "fair"])
def test_a_request_whose_client_left_is_not_granted_afterwards(service: Service, ns: str, shape: str) -> None:
    """The holder releases after the client has gone: with the request still waiting, the permit would
    go to it (a lease nobody holds, for its TTL of 60 s). ``one``: it waits in the semaphore's line;
    ``two``: over two semaphores, for the instance's wake-ups; ``fair``: in a fair queue, whose place goes
    too."""
    names = [f"{ns}a", f"{ns}b"] if shape == "two" else [f"{ns}a"]
    key = f"{ns}k"
    with permits.connect(service.url, owner=f"{ns}holder") as holder:
        for name in names:
            holder.create_semaphore(name, 1, fair=shape == "fair")
        held = holder.acquire(dict.fromkeys(names, 1), ttl=60)
        before = _gone_count(service)
        body = {"wants": dict.fromkeys(names, 1), "key": key, "owner": "w", "ttl": 60, "wait": 20}
        in_queue = (lambda: holder.waiters(names[0]) != []) if shape == "fair" else None
        _ask_and_leave(service, body, in_queue)
        assert wait_until(lambda: _gone_count(service) > before, timeout=10), "the request did not stop waiting"
        assert holder.waiters(names[0]) == []  # a fair queue's place went with it
        holder.release(held)
        time.sleep(1.0)  # had it still waited, it would have been granted by now
        for name in names:
            assert holder.get_semaphore(name).used == 0
    with permits.connect(service.url, owner="w") as client, pytest.raises(permits.LeaseNotFound):
        client.get_lease(key)


def test_a_client_that_asks_again_keeps_what_its_retry_was_given(service: Service, ns: str) -> None:
    """The client's connection drops while it waits, and it asks again under the same key at once. The
    first request stops waiting; nothing is released on the client's behalf, so the lease its retry gets
    stays held."""
    name, key = f"{ns}a", f"{ns}k"
    with permits.connect(service.url, owner=f"{ns}holder") as holder:
        holder.create_semaphore(name, 1)
        held = holder.acquire(name, ttl=60)
        body = {"wants": {name: 1}, "key": key, "owner": "w", "ttl": 60, "wait": 20}
        _ask_and_leave(service, body)
        with httpx.Client(base_url=service.url, timeout=30) as http:
            holder.release(held)
            again = http.post("/v1/leases", json=body)
        assert again.status_code == 201, again.text
        time.sleep(1.0)
        assert holder.get_semaphore(name).used == 1
        with permits.connect(service.url, owner="w") as client:
            assert client.get_lease(key).held
            client.release(key)
