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


def _serving(features: list[str], answer: Any) -> tuple[list[dict[str, Any]], Any]:
    """A transport that answers ``whoami`` as an instance with ``features``, and each acquire with
    ``answer(body, tries_so_far)``: a response, or an exception to raise (the connection dropped)."""
    asked: list[dict[str, Any]] = []

    def instance(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/whoami":
            about = {"identity": "x", "admin": False, "version": "v", "limits": {"max_wait": 5.0}}
            return httpx.Response(200, json={**about, "features": features})
        body = json.loads(request.content)
        asked.append(body)
        result = answer(body, len(asked))
        if isinstance(result, Exception):
            raise result
        return result

    return asked, instance


def _granted(body: dict[str, Any]) -> httpx.Response:
    lease = {
        "key": body["key"],
        "owner": body["owner"],
        "counts": {"s": 1},
        "tokens": {"s": 1},
        "acquired_at": "2026-11-29T00:00:00Z",
        "expires_at": "2026-11-29T00:01:00Z",
        "expires_in": 60.0,
        "held": True,
        "ttl": 60.0,
    }
    return httpx.Response(201, json=lease)


def _refused_field(field: str) -> httpx.Response:
    error = {"code": "invalid_argument", "message": f"{field}: Extra inputs are not permitted"}
    return httpx.Response(422, json={"error": {**error, "details": {"field": field}}})


_REAL_CLIENT = httpx.Client


def _connect_through(monkeypatch: pytest.MonkeyPatch, instance: Any) -> permits.Client:
    monkeypatch.setattr(httpx, "Client", lambda **kw: _REAL_CLIENT(transport=httpx.MockTransport(instance), **kw))
    return permits.connect("http://127.0.0.1:9", owner="o", retries=3)


def test_a_new_only_acquire_to_a_service_without_request_ids_is_not_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service that does not list ``request_id`` cannot tell a retry's lease from another's: the client sends
    no id, and does not send the request again after a dropped reply; the outcome is unknown."""
    asked, instance = _serving(["keep_place", "new_only", "lease_ttl"], lambda body, n: httpx.ReadError("reset"))
    with _connect_through(monkeypatch, instance) as client, pytest.raises(permits.StorageUnavailable):
        client.acquire("s", key="k", new_only=True, timeout=0)
    assert len(asked) == 1 and "request_id" not in asked[0] and asked[0]["new_only"] is True


def test_a_new_only_acquire_is_sent_again_with_its_request_id(monkeypatch: pytest.MonkeyPatch) -> None:
    asked, instance = _serving(
        ["new_only", "request_id"], lambda body, n: httpx.ReadError("reset") if n == 1 else _granted(body)
    )
    with _connect_through(monkeypatch, instance) as client:
        lease = client.acquire("s", key="k", new_only=True, timeout=0)
    assert lease.key == "k" and len(asked) == 2
    assert asked[0]["request_id"] == asked[1]["request_id"] and len(asked[0]["request_id"]) == 32


def test_an_older_instance_that_refuses_request_id_is_asked_without_it_unless_a_try_may_have_been_granted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rolling upgrade: the newer instance listed ``request_id``, the older one behind the same address
    refuses it. A first try that it refused is asked again without the id (and later ones are sent without
    it); but when that refusal answers a resend, the try before may have been granted: unknown outcome."""
    asked, instance = _serving(
        ["new_only", "request_id"],
        lambda body, n: _refused_field("request_id") if "request_id" in body else _granted(body),
    )
    with _connect_through(monkeypatch, instance) as client:
        assert client.acquire("s", key="k", new_only=True, timeout=0).key == "k"
        assert client.acquire("s", key="k2", new_only=True, timeout=0).key == "k2"
    assert ["request_id" in body for body in asked] == [True, False, False]

    asked, instance = _serving(
        ["new_only", "request_id"],
        lambda body, n: httpx.ReadError("reset") if n == 1 else _refused_field("request_id"),
    )
    with _connect_through(monkeypatch, instance) as client, pytest.raises(permits.StorageUnavailable, match="unknown"):
        client.acquire("s", key="k", new_only=True, timeout=0)
    assert len(asked) == 2


def test_a_release_by_request_id_is_refused_by_the_client_before_an_instance_without_release_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An older instance would release by key alone, whoever's lease it is: the client refuses at once and
    sends nothing. With the feature listed, the field is sent."""
    real_client = httpx.Client
    for features in (["keep_place", "new_only", "lease_ttl", "request_id"], ["request_id", "release_own"]):
        asked, instance = _serving(features, lambda body, n: httpx.Response(200, json={"outcome": "not_found"}))
        transport = httpx.MockTransport(instance)
        monkeypatch.setattr(httpx, "Client", lambda transport=transport, **kw: real_client(transport=transport, **kw))
        with permits.connect("http://127.0.0.1:9", owner="o") as client:
            if "release_own" in features:
                assert client.release("k", request_id="r-1") is permits.ReleaseOutcome.NOT_FOUND
                assert asked == [{"key": "k", "owner": "o", "request_id": "r-1"}]
            else:
                with pytest.raises(permits.UsageError, match="too old"):
                    client.release("k", request_id="r-1")
                assert asked == []
        monkeypatch.undo()


def test_a_sweep_with_a_timeout_sends_the_time_left_and_waits_for_its_answer_that_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The service works on a sweep up to its ``timeout``: the client sends the time left, and waits for the
    answer that long and the service's grace (before, at most 30 s, whatever the timeout: a sweep of a large
    backlog was cut, and sent again while the first still ran). A reconcile alike."""
    read_timeouts: list[float] = []

    def answer(body: dict[str, Any], n: int) -> httpx.Response:
        if "repair" in body:
            return httpx.Response(200, json={"drift": []})
        return httpx.Response(200, json={"leases": 0, "batches": 1, "keys": [], "complete": False})

    asked, instance = _serving(["upkeep_timeout"], answer)

    def timed_instance(request: httpx.Request) -> httpx.Response:
        read_timeouts.append(request.extensions["timeout"]["read"])
        return instance(request)

    with _connect_through(monkeypatch, timed_instance) as client:
        assert client.sweep(timeout=100).complete is False
        assert client.reconcile(repair=True, timeout=100) == []
        assert client.reconcile(repair=True) == []
    assert 99 < asked[0]["timeout"] <= 100 and 99 < asked[1]["timeout"] <= 100 and "timeout" not in asked[2]
    assert read_timeouts[1] > 100 and read_timeouts[2] > 100, read_timeouts  # [0] is whoami's
    assert read_timeouts[3] == 30, read_timeouts  # no timeout: a reply's usual wait


def test_a_sweep_without_a_timeout_goes_in_parts_and_none_is_sent_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no timeout of the caller's, a sweep through a service goes in parts, each held to
    SWEEP_PART_SECONDS there and so answered well within a reply's wait, until one is complete; the result
    adds them up. A part whose answer is lost is not sent again (another sweep would run beside it): its
    outcome is unknown. (Before, one sweep of a long backlog was cut at 30 s and sent again while it ran.)"""
    keys = [{"owner": "o", "key": key} for key in "abc"]
    parts = [
        {"leases": 2, "batches": 2, "keys": keys[:2], "complete": False},
        {"leases": 1, "batches": 1, "keys": keys[2:], "complete": True},
    ]
    read_timeouts: list[float] = []
    asked, instance = _serving(["upkeep_timeout"], lambda body, n: httpx.Response(200, json=parts[n - 1]))

    def timed_instance(request: httpx.Request) -> httpx.Response:
        read_timeouts.append(request.extensions["timeout"]["read"])
        return instance(request)

    with _connect_through(monkeypatch, timed_instance) as client:
        swept = client.sweep(max_batches=10)
    assert swept == permits.SweepResult(leases=3, batches=3, keys=[("o", "a"), ("o", "b"), ("o", "c")], complete=True)
    assert [body["max_batches"] for body in asked] == [10, 8]
    assert all(19 < body["timeout"] <= 20 for body in asked), asked
    assert all(44 < wait <= 45 for wait in read_timeouts[1:]), read_timeouts  # the part's 20 s and the grace
    monkeypatch.undo()

    # A part that ended no batch and is not complete (a service that did nothing): no part after it.
    stuck = {"leases": 0, "batches": 0, "keys": [], "complete": False}
    asked, instance = _serving(["upkeep_timeout"], lambda body, n: httpx.Response(200, json=stuck))
    with _connect_through(monkeypatch, instance) as client:
        assert client.sweep() == permits.SweepResult(complete=False)
    assert len(asked) == 1
    monkeypatch.undo()

    asked, instance = _serving(["upkeep_timeout"], lambda body, n: httpx.ReadError("reset"))
    with _connect_through(monkeypatch, instance) as client, pytest.raises(permits.StorageUnavailable, match="may"):
        client.sweep()
    assert len(asked) == 1


def test_a_sweep_to_an_older_instance_is_sent_no_timeout_and_reads_as_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service without ``upkeep_timeout`` is not sent the field; one that listed it but has an older
    instance behind the same address (a rolling upgrade) is asked again without it, and from then on. An
    older service's answer has no ``complete``: taken as complete, as before."""
    old_answer = httpx.Response(200, json={"leases": 0, "batches": 0, "keys": []})
    asked, instance = _serving([], lambda body, n: old_answer)
    with _connect_through(monkeypatch, instance) as client:
        assert client.sweep(timeout=5).complete is True
    assert asked == [{"batch_size": 500, "max_batches": None}]
    monkeypatch.undo()

    asked, instance = _serving(
        ["upkeep_timeout"], lambda body, n: _refused_field("timeout") if "timeout" in body else old_answer
    )
    with _connect_through(monkeypatch, instance) as client:
        assert client.sweep(timeout=5).complete is True
        assert client.sweep(timeout=5).complete is True
    assert ["timeout" in body for body in asked] == [True, False, False]
