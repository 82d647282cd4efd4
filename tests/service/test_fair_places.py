"""A request that stops waiting gives up its place in a fair semaphore's queue (docs/service.md,
"Waiting"). Places otherwise last 5 s unless asked again, and clients whose waits are shorter than that,
each under a new key, used to leave a dead place at the head of the queue for every live waiter to time
out behind: on a real service, the queue never moved again once it had filled."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import permits
from tests._children import spawn
from tests._service import Service, metric, module_db_url, running

pytestmark = pytest.mark.usefixtures("servers")

MAX_WAIT = 1.0


@pytest.fixture(scope="module", params=["sqlite", "mysql", "postgresql"])
def service(
    request: pytest.FixtureRequest, servers: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    url = module_db_url(str(request.param), servers, tmp_path_factory, "places")
    env = {"PERMITS_LIMITS__MAX_WAIT": str(MAX_WAIT), "PERMITS_MAINTENANCE__ENABLED": "false"}
    with running(url, env=env) as svc:
        yield svc


@pytest.fixture
def full(service: Service, ns: str) -> Iterator[str]:
    """A fair semaphore of one permit, held."""
    name = f"{ns}fair"
    with permits.connect(service.url, owner=f"{ns}holder") as client:
        client.create_semaphore(name, 1, fair=True)
        lease = client.acquire(name, ttl=60)
        yield name
        client.release(lease)


def _waiting(http: httpx.Client, name: str) -> list[dict[str, Any]]:
    response = http.get(f"/v1/waiters/{name}")
    assert response.status_code == 200, response.text
    waiters: list[dict[str, Any]] = response.json()["waiters"]
    return waiters


def test_a_request_that_times_out_gives_up_its_place(service: Service, full: str, ns: str) -> None:
    with httpx.Client(base_url=service.url, timeout=30) as http:
        response = http.post("/v1/leases", json={"wants": {full: 1}, "key": f"{ns}k", "wait": 0.3})
        assert response.status_code == 409, response.text
        assert _waiting(http, full) == []


def test_a_place_kept_for_a_retry_is_given_up_on_request(service: Service, full: str, ns: str) -> None:
    with httpx.Client(base_url=service.url, timeout=30) as http:
        asked = {"wants": {full: 1}, "key": f"{ns}k", "wait": 0.3, "keep_place": True}
        assert http.post("/v1/leases", json=asked).status_code == 409
        [kept] = _waiting(http, full)
        assert http.post("/v1/leases", json=asked).status_code == 409  # the retry keeps the same place
        assert [w["ticket"] for w in _waiting(http, full)] == [kept["ticket"]]
        gave_up = http.post("/v1/leases/give-up", json={"key": f"{ns}k"})
        assert gave_up.status_code == 200 and gave_up.json() == {"places": 1}, gave_up.text
        assert _waiting(http, full) == []
        assert http.post("/v1/leases/give-up", json={"key": f"{ns}k"}).json() == {"places": 0}


def test_the_python_client_keeps_its_place_past_max_wait_and_gives_it_up_at_its_timeout(
    service: Service, full: str, ns: str
) -> None:
    """The client asks again every ``max_wait`` (1 s here) with the same key: its place, and so its order
    among the waiters, lasts for its whole timeout, and goes when the timeout ends."""
    with permits.connect(service.url, owner=f"{ns}w") as client, httpx.Client(base_url=service.url) as http:
        began = time.monotonic()
        with pytest.raises(permits.AcquireTimeout):
            client.acquire(full, key=f"{ns}k", ttl=30, timeout=2.5)
        assert time.monotonic() - began >= 2.4
        assert _waiting(http, full) == []


def test_a_409_says_whether_the_service_kept_a_place(service: Service, full: str, ns: str) -> None:
    with permits.connect(service.url, owner=f"{ns}h") as holder, httpx.Client(base_url=service.url) as http:
        holder.create_semaphore(f"{ns}plain", 1)
        lease = holder.acquire(f"{ns}plain", ttl=60)
        for name, kept in ((full, True), (f"{ns}plain", False)):
            asked = {"wants": {name: 1}, "key": f"{ns}k-{kept}", "wait": 0.3, "keep_place": True}
            response = http.post("/v1/leases", json=asked)
            assert response.status_code == 409, response.text
            assert response.json()["error"]["details"]["kept_place"] is kept
        # Every 409 acquire_timeout says it, in the same shape: one that did not ask to keep its place, or
        # did not wait, keeps none.
        for asked in (
            {"wants": {full: 1}, "key": f"{ns}k-given-up", "wait": 0.3},
            {"wants": {full: 1}, "key": f"{ns}k-no-wait", "keep_place": True},
        ):
            response = http.post("/v1/leases", json=asked)
            assert response.status_code == 409, response.text
            details = response.json()["error"]["details"]
            assert details["kept_place"] is False and {"key", "owner", "timeout"} <= set(details), details
        holder.release(lease)


def test_the_python_client_gives_up_only_a_place_that_was_kept(service: Service, full: str, ns: str) -> None:
    """A give-up is a request and a write on the database: after a timeout on a plain semaphore, which
    keeps no places, the client does not send one."""

    def give_ups() -> float:
        return metric(service, 'permits_http_requests_total{route="/v1/leases/give-up",status="200"}') or 0.0

    with permits.connect(service.url, owner=f"{ns}w") as client:
        client.create_semaphore(f"{ns}plain", 1)
        lease = client.acquire(f"{ns}plain", ttl=60)
        before = give_ups()
        with pytest.raises(permits.AcquireTimeout):
            client.acquire(f"{ns}plain", ttl=30, timeout=0.3)
        assert give_ups() == before
        with pytest.raises(permits.AcquireTimeout):
            client.acquire(full, ttl=30, timeout=0.3)
        assert give_ups() == before + 1
        client.release(lease)


def test_a_stream_of_impatient_clients_does_not_stall_the_queue(service: Service, ns: str, tmp_path: Path) -> None:
    """Three processes acquire through the service with a timeout of 0.4 s, a new key each time, while the
    only permit is held for 3 s and so every request times out; then it is released. Grants must come
    again at once. Before a timed-out request gave up its place, none came for as long as the clients
    kept asking."""
    name = f"{ns}stream"
    stop = tmp_path / "stop"
    with permits.connect(service.url, owner=f"{ns}holder") as holder:
        holder.create_semaphore(name, 1, fair=True)
        lease = holder.acquire(name, ttl=60)
        children = [
            spawn(
                "impatient",
                {"url": service.url, "owner": f"{ns}c{i}", "name": name, "timeout": 0.4, "stop": str(stop)},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
            )
            for i in range(3)
        ]
        try:
            for child in children:
                assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            time.sleep(3)
            holder.release(lease)
            released = time.monotonic()
            time.sleep(5)
            stop.touch()
            results = []
            for child in children:
                out, _ = child.communicate(timeout=30)
                assert child.returncode == 0
                results.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
    after = [[t for t in r["grants"] if t > released] for r in results]
    assert all(r["timeouts"] > 0 for r in results), results  # the held permit made them time out
    assert sum(len(g) for g in after) >= 10, [len(g) for g in after]
    assert min(min(g) for g in after if g) - released < 1.5, "the first grant after the release came late"


def test_bad_input_to_the_new_fields_is_refused(service: Service, ns: str) -> None:
    with httpx.Client(base_url=service.url, timeout=30) as http:
        nul = http.post("/v1/leases/give-up", json={"key": f"{ns}k", "owner": "a\x00b"})
        assert nul.status_code == 422 and nul.json()["error"]["details"]["field"] == "owner", nul.text
        no_key = http.post("/v1/leases/give-up", json={"owner": "a"})
        assert no_key.status_code == 422, no_key.text
        asked = {"wants": {f"{ns}x": 1}, "wait": 0.1, "keep_place": "yes"}
        assert http.post("/v1/leases", json=asked).status_code == 422
