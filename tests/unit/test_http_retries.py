"""What the Python client sends again to a permits service, and when (the HTTP store's ``_call``). The
service here is a scripted instance (httpx's mock transport), which can answer what a real one rarely
does on cue: a 503 from its database, a proxy's 502 page, a refused connection during a restart. The
service's own side of each answer has tests of its own against real processes (tests/service)."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import permits

Answer = Callable[[httpx.Request], httpx.Response]


def _error(status: int, code: str, **details: Any) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": code, "details": details}})


def _whoami(max_wait: float = 5.0) -> httpx.Response:
    about = {"identity": "x", "admin": True, "version": "new", "limits": {"max_wait": max_wait}}
    return httpx.Response(200, json={**about, "features": ["keep_place"]})


LEASE = {
    "key": "k",
    "owner": "o",
    "tokens": {"s": "7"},
    "counts": {"s": 1},
    "acquired_at": "2026-11-28T12:00:00+00:00",
    "expires_at": "2026-11-28T12:00:30+00:00",
    "expires_in": 30.0,
}


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[httpx.Request]]:
    """Route the client's requests to a scripted instance whose ``max_wait`` is given; returns the list of
    requests it is sent (whoami aside)."""
    real_client = httpx.Client

    def install(answer: Answer, max_wait: float = 5.0) -> list[httpx.Request]:
        sent: list[httpx.Request] = []

        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/whoami":
                return _whoami(max_wait)
            sent.append(request)
            return answer(request)

        transport = httpx.MockTransport(handler)
        monkeypatch.setattr(httpx, "Client", lambda **kw: real_client(transport=transport, **kw))
        return sent

    return install


def _lease_after_failures(failures: int, failure: Callable[[], httpx.Response]) -> Answer:
    asked = 0

    def answer(request: httpx.Request) -> httpx.Response:
        nonlocal asked
        asked += 1
        if asked <= failures:
            return failure()
        return httpx.Response(201, json={**LEASE, "key": json.loads(request.content)["key"]})

    return answer


def test_each_resend_of_an_acquire_asks_only_for_what_is_left_of_its_wait(service: Any) -> None:
    sent = service(_lease_after_failures(3, lambda: _error(503, "service_unavailable", limit="prelock_wait")))
    with permits.connect("http://127.0.0.1:9", owner="o") as client:
        lease = client.acquire("s", key="k", ttl=30, timeout=2)
    assert lease.key == "k"
    bodies = [json.loads(request.content) for request in sent]
    assert {body["key"] for body in bodies} == {"k"}  # the same key every time: never granted twice
    waits = [body["wait"] for body in bodies]
    assert waits[0] == pytest.approx(2, abs=0.05)
    assert all(later < earlier for earlier, later in itertools.pairwise(waits)), waits


def test_a_proxy_failure_page_is_sent_again_like_a_dropped_connection(service: Any) -> None:
    sent = service(_lease_after_failures(2, lambda: httpx.Response(502, text="<html>Bad Gateway</html>")))
    with permits.connect("http://127.0.0.1:9", owner="o") as client:
        assert client.acquire("s", key="k", ttl=30, timeout=1).key == "k"
    assert len(sent) == 3


def test_a_proxy_failure_page_that_lasts_raises_storage_unavailable(service: Any) -> None:
    sent = service(lambda request: httpx.Response(504, text="Gateway Timeout"))
    with (
        permits.connect("http://127.0.0.1:9", owner="o", retries=2) as client,
        pytest.raises(permits.StorageUnavailable, match="proxy"),
    ):
        client.release("k")
    assert len(sent) == 3


@pytest.mark.parametrize(
    ("answer", "resent"),
    [
        (lambda: _error(503, "storage_unavailable"), False),  # it may have committed before the link went
        (lambda: httpx.Response(502, text="Bad Gateway"), False),
        (lambda: _error(503, "service_unavailable", limit="shutdown"), True),  # refused before any work
        (lambda: _error(409, "storage_conflict"), True),  # rolled back
    ],
)
def test_a_delete_is_sent_again_only_after_an_answer_that_says_it_was_not_carried_out(
    service: Any, answer: Callable[[], httpx.Response], resent: bool
) -> None:
    """Done twice, a delete could remove (and with force, revoke the leases of) a semaphore made again
    under the same name in between."""

    def scripted(request: httpx.Request) -> httpx.Response:
        return answer() if len(sent) == 1 else httpx.Response(200, json={"revoked": 0})

    sent = service(scripted)
    with permits.connect("http://127.0.0.1:9", owner="o") as client:
        if resent:
            client.delete_semaphore("s")
        else:
            with pytest.raises(permits.StorageUnavailable):
                client.delete_semaphore("s")
    assert len(sent) == (2 if resent else 1)


def test_a_service_that_allows_no_wait_is_not_asked_in_a_tight_loop(service: Any) -> None:
    """With ``max_wait`` 0 the service answers a waiting acquire at once: the client sleeps between
    attempts itself, as it does against a database."""
    sent = service(lambda request: _error(409, "acquire_timeout"), max_wait=0)
    with permits.connect("http://127.0.0.1:9", owner="o") as client, pytest.raises(permits.AcquireTimeout):
        client.acquire("s", key="k", ttl=30, timeout=1)
    # Polling with backoff from 20 ms up: about ten attempts in a second, where it made thousands.
    assert 2 <= len(sent) <= 30, len(sent)


def test_a_waiting_acquire_rides_out_a_restart_of_its_only_instance(service: Any) -> None:
    """Connections are refused for a second and a half (the instance restarting): an acquire that may
    wait three seconds keeps trying, where its five quick retries were spent within 0.2 s."""
    back_at = time.monotonic() + 1.5

    def answer(request: httpx.Request) -> httpx.Response:
        if time.monotonic() < back_at:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(201, json={**LEASE, "key": json.loads(request.content)["key"]})

    sent = service(answer)
    with permits.connect("http://127.0.0.1:9", owner="o") as client:
        assert client.acquire("s", key="k", ttl=30, timeout=3).key == "k"
        assert client.try_acquire("s", key="k2", ttl=30) is not None
    assert len(sent) > 6


def test_a_call_that_does_not_wait_still_gives_up_on_a_service_that_is_down(service: Any) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    sent = service(answer)
    with permits.connect("http://127.0.0.1:9", owner="o", retries=3) as client:
        started = time.monotonic()
        with pytest.raises(permits.StorageUnavailable):
            client.release("k")
        assert time.monotonic() - started < 5
    assert len(sent) == 4


def test_places_kept_before_an_older_instance_refused_keep_place_are_given_up(service: Any) -> None:
    """A rolling upgrade: the newer instance kept the request's place, the older one then refused the
    field. At its timeout the client still gives up what the newer one kept."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/leases/give-up":
            return httpx.Response(200, json={"places": 1})
        body = json.loads(request.content)
        if "keep_place" in body and len(sent) > 1:  # the older instance
            return _error(422, "invalid_argument", field="keep_place")
        return _error(409, "acquire_timeout")

    sent = service(answer)
    with permits.connect("http://127.0.0.1:9", owner="o") as client, pytest.raises(permits.AcquireTimeout):
        client.acquire("s", key="k", ttl=30, timeout=0.5)
    assert sent[-1].url.path == "/v1/leases/give-up"


def _lost_then(refusal: Callable[[], httpx.Response], refusals: int) -> Answer:
    """The first send's answer lost (the connection reset after it arrived: it may have been granted),
    then ``refusals`` refusals that say "not carried out" (for their own send), then the lease."""
    asked = 0

    def answer(request: httpx.Request) -> httpx.Response:
        nonlocal asked
        asked += 1
        if asked == 1:
            raise httpx.ReadError("connection reset by peer", request=request)
        if asked <= 1 + refusals:
            return refusal()
        return httpx.Response(201, json={**LEASE, "key": json.loads(request.content)["key"]})

    return answer


@pytest.mark.parametrize(
    "refusal",
    [
        lambda: _error(429, "limit_exceeded", limit="max_waiters"),
        lambda: _error(503, "service_unavailable", limit="shutdown"),
        lambda: _error(409, "storage_conflict"),
    ],
)
def test_a_refusal_after_a_lost_answer_says_the_request_may_have_been_carried_out(
    service: Any, refusal: Callable[[], httpx.Response], caplog: pytest.LogCaptureFixture
) -> None:
    """The first send of an acquire may have been granted (its answer was lost); the retries land where
    they are refused with an answer that says "not carried out" for their own send (an instance's line
    full, an instance draining). The caller is told the outcome is unknown (StorageUnavailable), not that
    nothing was done: it raised LimitExceeded (or ServiceUnavailable, StorageConflict), and a caller that
    trusted it and asked again under a new key took a second permit while the first was held to its TTL.
    A waiting acquire rides it out as an outage and gets its lease, under the same key."""
    sent = service(_lost_then(refusal, refusals=100))
    with (
        permits.connect("http://127.0.0.1:9", owner="o", retries=2) as client,
        pytest.raises(permits.StorageUnavailable, match="may have been carried out"),
    ):
        client.try_acquire("s", key="k", ttl=30)
    assert len(sent) in (2, 3)  # a try's conflict is final at once (the service retried it already)
    # Refusals past one call's retries: the client's next call (its ride-out of the unknown outcome)
    # remembers the unanswered send, and goes on asking under the same key until it is answered.
    sent = service(_lost_then(refusal, refusals=8))
    with (
        permits.connect("http://127.0.0.1:9", owner="o", retries=2) as client,
        caplog.at_level(logging.WARNING, logger="permits.client"),
    ):
        assert client.acquire("s", key="k", ttl=30, timeout=60).key == "k"
    assert len(sent) == 10 and {json.loads(request.content)["key"] for request in sent} == {"k"}
    # The service answered every time: that is no outage (an interrupt meanwhile still releases by key).
    assert not [m for m in caplog.messages if "through an outage" in m], caplog.messages


def test_a_refusal_with_no_lost_answer_before_it_is_raised_as_it_is(service: Any) -> None:
    """The counter-check: with every earlier send answered, a full line's 429 is the LimitExceeded it says."""
    sent = service(lambda request: _error(429, "limit_exceeded", limit="max_waiters"))
    with (
        permits.connect("http://127.0.0.1:9", owner="o", retries=2) as client,
        pytest.raises(permits.LimitExceeded),
    ):
        client.try_acquire("s", key="k", ttl=30)
    assert len(sent) == 3
