"""A retry whose reply was lost, sent to another instance (behind a load balancer), while that instance
has requests waiting for the very permit the retry's lease holds. It joins that instance's line as a new
request; it used to wait there until every request ahead of it gave up, and the requests ahead waited for
a permit that only the retry's answer would let its client release: each retry cost its whole wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

import permits
from tests._service import Service, module_db_url, running

pytestmark = pytest.mark.usefixtures("servers")


@pytest.fixture(scope="module", params=["sqlite", "mysql", "postgresql"])
def instances(
    request: pytest.FixtureRequest, servers: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Service, Service]]:
    url = module_db_url(str(request.param), servers, tmp_path_factory, "retry")
    env = {"PERMITS_MAINTENANCE__ENABLED": "false"}
    with running(url, env=env) as a, running(url, env=env) as b:
        yield a, b


@dataclass
class _Scene:
    """x holds the one permit, granted through a; y waits in b's line for it."""

    asked: dict[str, Any]
    granted: httpx.Response
    via_a: httpx.Client
    via_b: httpx.Client
    waiting: list[httpx.Response]


@contextmanager
def _x_held_and_y_waiting(instances: tuple[Service, Service], ns: str) -> Iterator[_Scene]:
    """The scene, then: x released through b, and y granted the permit x gave back."""
    a, b = instances
    name = f"{ns}s"
    with permits.connect(a.url) as admin:
        admin.create_semaphore(name, 1)
    asked = {"wants": {name: 1}, "key": f"{ns}x", "owner": "x", "ttl": 60}
    with httpx.Client(base_url=a.url, timeout=30) as via_a, httpx.Client(base_url=b.url, timeout=30) as via_b:
        granted = via_a.post("/v1/leases", json=asked)
        assert granted.status_code == 201, granted.text
        waiting: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: waiting.append(
                httpx.post(f"{b.url}/v1/leases", json={"wants": {name: 1}, "key": f"{ns}y", "wait": 8}, timeout=30)
            )
        )
        waiter.start()
        time.sleep(0.5)  # y waits in b's line for the permit x holds
        yield _Scene(asked, granted, via_a, via_b, waiting)
        assert via_b.post("/v1/leases/release", json={"key": f"{ns}x", "owner": "x"}).json()["outcome"] == "released"
        waiter.join(30)
    assert waiting and waiting[0].status_code == 201, waiting  # and y got the permit x gave back


def test_a_retry_on_another_instance_gets_its_lease_back_without_waiting_out_the_line(
    instances: tuple[Service, Service], ns: str
) -> None:
    with _x_held_and_y_waiting(instances, ns) as scene:
        started = time.monotonic()
        again = scene.via_b.post("/v1/leases", json={**scene.asked, "wait": 10})
        took = time.monotonic() - started
        assert again.status_code == 201 and again.json()["tokens"] == scene.granted.json()["tokens"], again.text
        assert took < 3.0, took


def test_a_request_for_a_new_lease_only_is_refused_on_another_instance_with_a_line(
    instances: tuple[Service, Service], ns: str
) -> None:
    """The same scene, with the second request asking for a new lease only: it asks at once, before it would
    join b's line (whose turn would then answer it alone, never with x's lease as a retry's), and is refused
    at once; x is left as it was."""
    with _x_held_and_y_waiting(instances, ns) as scene:
        started = time.monotonic()
        refused = scene.via_b.post("/v1/leases", json={**scene.asked, "wait": 10, "new_only": True})
        took = time.monotonic() - started
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "key_in_use" and refused.json()["error"]["details"]["held"] is True
        assert took < 3.0, took
        lease = scene.via_a.get(f"/v1/leases/{ns}x", params={"owner": "x"}).json()
        assert lease["end_reason"] is None and lease["tokens"] == scene.granted.json()["tokens"]


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_a_request_for_a_new_lease_only_takes_its_turn_in_a_busy_line(db_url: str, ns: str) -> None:
    """A mutex kept busy through the service by threads that wait in its line: a ``new_only`` request is
    granted in its turn, as a plain one is. When it asked outside the line, the line's turns took every
    permit that came back and it timed out (docs/benchmarks.md, benchmarks/new_only_wait.py)."""
    name = f"{ns}busy"
    stop = threading.Event()

    def keep_busy(i: int) -> None:
        with permits.connect(service.url, owner=f"{ns}w{i}") as client:
            while not stop.is_set():
                lease = client.acquire(name, ttl=30, timeout=30)
                time.sleep(0.005)
                client.release(lease)

    with running(db_url) as service, permits.connect(service.url, owner=f"{ns}probe") as probe:
        probe.create_semaphore(name, 1)
        workers = [threading.Thread(target=keep_busy, args=(i,)) for i in range(6)]
        for worker in workers:
            worker.start()
        try:
            time.sleep(1)  # the line has formed
            for i in range(5):
                lease = probe.acquire(name, key=f"{ns}job-{i}", ttl=30, timeout=5, new_only=True)
                probe.release(lease)
        finally:
            stop.set()
            for worker in workers:
                worker.join(30)


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_a_request_for_a_new_lease_only_behind_a_plain_one_under_its_key_is_refused_at_its_turn(
    db_url: str, ns: str
) -> None:
    """In one instance's line, a plain request under key K, then a ``new_only`` one under K (another
    request): they keep separate places, the turn that grants the plain one stops before the other, which
    then asks alone and is refused (key_in_use), never answered with the plain request's lease."""
    name, key = f"{ns}mutex", f"{ns}K"
    answers: dict[str, httpx.Response] = {}
    with running(db_url) as service, httpx.Client(base_url=service.url, timeout=30) as http:
        assert http.post("/v1/semaphores", json={"name": name, "capacity": 1}).status_code == 201
        held = http.post("/v1/leases", json={"wants": {name: 1}, "key": f"{ns}holder", "owner": "o"})
        assert held.status_code == 201

        def ask(label: str, **extra: Any) -> None:
            body = {"wants": {name: 1}, "key": key, "owner": "o", "wait": 10, **extra}
            with httpx.Client(base_url=service.url, timeout=30) as own:
                answers[label] = own.post("/v1/leases", json=body)

        plain = threading.Thread(target=ask, args=("plain",))
        plain.start()
        time.sleep(0.5)  # in the line
        claim = threading.Thread(target=ask, args=("new_only",), kwargs={"new_only": True, "request_id": "claim"})
        claim.start()
        time.sleep(0.5)  # in the line, behind it
        assert http.post("/v1/leases/release", json={"key": f"{ns}holder", "owner": "o"}).status_code == 200
        plain.join(20)
        claim.join(20)
    assert answers["plain"].status_code == 201, answers["plain"].text
    assert answers["new_only"].status_code == 409, answers["new_only"].text
    assert answers["new_only"].json()["error"]["code"] == "key_in_use"
