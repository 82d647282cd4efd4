"""The dashboard's API on a real ``permits serve``, on every backend: the overview's counts, the charts'
history (which outlives the instance), lease endings, the admin log, the live feed and who may read what.
The page itself is tested in a browser (tests/dashboard)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests._service import Service, running, wait_until

ADMIN, ALICE, BOB = "dash-admin-token-0123456789", "dash-alice-token-0123456789", "dash-bob-token-0123456789"
RUN = uuid.uuid4().hex[:6]
OPS, ALICE_ID, BOB_ID = f"ops-{RUN}", f"alice-{RUN}", f"bob-{RUN}"
TOKENS = [
    {"name": OPS, "token": ADMIN, "admin": True},
    {"name": ALICE_ID, "token": ALICE},
    {"name": BOB_ID, "token": BOB},
]
#: Samples every second, so a test sees its charts fill without waiting ten.
FAST = {
    "PERMITS_DASHBOARD__STEP": "1",
    "PERMITS_DASHBOARD__POLL_INTERVAL": "0.2",
    "PERMITS_MAINTENANCE__SWEEP_INTERVAL": "1",
}


@pytest.fixture(scope="module", params=["sqlite", "mysql", "postgresql"])
def db(request: pytest.FixtureRequest, servers: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('dash') / 'permits.db'}"
    return str(servers.url_for(str(request.param)).render_as_string(hide_password=False))


@pytest.fixture(scope="module")
def service(db: str) -> Iterator[Service]:
    with running(db, tokens=TOKENS, env=FAST) as svc:
        yield svc


def _http(service: Service, token: str | None = ADMIN) -> httpx.Client:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.Client(base_url=service.url, headers=headers, timeout=30)


def _row(overview: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in overview["semaphores"] if s["name"] == name)


def test_the_overview_counts_use_waiters_refusals_and_instances(service: Service, ns: str) -> None:
    name = f"{ns}backups"
    with _http(service) as admin, _http(service, ALICE) as alice:
        assert admin.post("/v1/semaphores", json={"name": name, "capacity": 2, "reason": "nightly"}).status_code == 201
        for _ in range(2):
            assert alice.post("/v1/leases", json={"wants": {name: 1}, "ttl": 60}).status_code == 201
        assert alice.post("/v1/leases", json={"wants": {name: 1}}).status_code == 409  # refused
        waiter = threading.Thread(target=lambda: alice.post("/v1/leases", json={"wants": {name: 1}, "wait": 4}))
        waiter.start()
        try:
            row = wait_until(lambda: _waiting_row(alice, name), timeout=15)
        finally:
            waiter.join(10)
        assert (row["capacity"], row["used"], row["available"], row["full"]) == (2, 2, 0, True)
        assert len(row["util"]) == 60
        overview = wait_until(lambda: _with_util(alice, name), timeout=15)
        full = _row(overview, name)
        # This minute's mean: full since just after the semaphore was created.
        assert 0 < max(u for u in full["util"] if u is not None) <= 1
        assert full["refused_per_min"] > 0
        assert overview["instances"] >= 1
        # The filter is a prefix.
        assert [s["name"] for s in alice.get("/v1/overview", params={"prefix": name}).json()["semaphores"]] == [name]


def _waiting_row(client: httpx.Client, name: str) -> dict[str, Any] | None:
    row = _row(client.get("/v1/overview").json(), name)
    return row if row["waiting"] >= 1 else None


def _with_util(client: httpx.Client, name: str) -> dict[str, Any] | None:
    overview = client.get("/v1/overview").json()
    row = _row(overview, name)
    return overview if any(u is not None for u in row["util"]) and row["refused_per_min"] > 0 else None


def test_stats_chart_grants_refusals_waits_and_holds_per_minute(service: Service, ns: str) -> None:
    name = f"{ns}charts"
    with _http(service) as admin, _http(service, ALICE) as alice:
        admin.post("/v1/semaphores", json={"name": name, "capacity": 1})
        for _ in range(3):
            lease = alice.post("/v1/leases", json={"wants": {name: 1}, "ttl": 60}).json()
            assert alice.post("/v1/leases", json={"wants": {name: 1}}).status_code == 409
            time.sleep(0.2)
            assert alice.post("/v1/leases/release", json={"key": lease["key"]}).status_code == 200

        def charted() -> dict[str, Any] | None:
            points = alice.get(f"/v1/stats/{name}", params={"minutes": 3}).json()["points"]
            recent = [p for p in points if p["grants"] or p["refused"]]
            total = lambda k: sum(p[k] or 0 for p in points)  # noqa: E731
            done = total("refused") >= 3 and total("grants") >= 3 and any(p["hold_p50_ms"] for p in points)
            return {"points": points, "recent": recent} if done else None

        found = wait_until(charted, timeout=30, interval=0.5)
        points = found["points"]
        assert len(points) == 3 and points[0]["t"] < points[-1]["t"]
        assert any(p["wait_p50_ms"] is not None for p in points)
        holds = [p["hold_p50_ms"] for p in points if p["hold_p50_ms"]]
        assert all(150 <= h <= 5000 for h in holds), holds
        assert alice.get("/v1/stats/no-such-semaphore-" + ns).status_code == 404


def test_endings_give_reasons_and_hide_other_clients_keys(service: Service, ns: str) -> None:
    name = f"{ns}ends"
    with _http(service) as admin, _http(service, ALICE) as alice, _http(service, BOB) as bob:
        admin.post("/v1/semaphores", json={"name": name, "capacity": 3})
        released = alice.post("/v1/leases", json={"wants": {name: 1}, "ttl": 60}).json()
        alice.post("/v1/leases/release", json={"key": released["key"]})
        revoked = alice.post("/v1/leases", json={"wants": {name: 1}, "ttl": 60}).json()
        holder = alice.get(f"/v1/holders/{name}").json()["holders"][0]
        answer = admin.post(
            "/v1/leases/revoke", json={"key": revoked["key"], "owner": holder["owner"], "reason": "stuck job"}
        )
        assert answer.status_code == 200, answer.text
        alice.post("/v1/leases", json={"wants": {name: 1}, "ttl": 1})
        endings = wait_until(lambda: _endings_with(alice, name, 3), timeout=20)
        reasons = {e["reason"] for e in endings}
        assert {"revoked", "released"} <= reasons and reasons & {"expired", "swept"}, reasons
        by_reason = {e["reason"]: e for e in endings}
        assert by_reason["revoked"]["note"].endswith("stuck job")
        assert by_reason["released"]["key"] == released["key"] and by_reason["released"]["held_seconds"] >= 0
        assert all(e["key"] is None for e in bob.get(f"/v1/endings/{name}").json()["endings"])


def _endings_with(client: httpx.Client, name: str, n: int) -> list[dict[str, Any]] | None:
    endings = client.get(f"/v1/endings/{name}").json()["endings"]
    return endings if len(endings) >= n else None


def test_admin_actions_are_logged_with_their_reasons_and_clients_cannot_take_them(service: Service, ns: str) -> None:
    name = f"{ns}admin"
    with _http(service) as admin, _http(service, ALICE) as alice:
        assert alice.post("/v1/semaphores", json={"name": name, "capacity": 1, "reason": "x"}).status_code == 403
        assert admin.post("/v1/semaphores", json={"name": name, "capacity": 1, "reason": "new pool"}).status_code == 201
        assert alice.patch(f"/v1/semaphores/{name}", json={"capacity": 9, "reason": "x"}).status_code == 403
        assert admin.patch(f"/v1/semaphores/{name}", json={"capacity": 4, "reason": "more disks"}).status_code == 200
        lease = alice.post("/v1/leases", json={"wants": {name: 1}, "ttl": 60}).json()
        owner = alice.get(f"/v1/holders/{name}").json()["holders"][0]["owner"]
        no_reason = admin.post("/v1/leases/revoke", json={"key": lease["key"], "owner": owner, "reason": " "})
        assert no_reason.status_code == 422 and no_reason.json()["error"]["code"] == "invalid_argument"
        assert (
            admin.post("/v1/leases/revoke", json={"key": lease["key"], "owner": owner, "reason": "runaway"}).status_code
            == 200
        )
        assert admin.delete(f"/v1/semaphores/{name}", params={"reason": "retired"}).status_code == 200
        entries = admin.get("/v1/admin-log", params={"name": name}).json()["entries"]
        assert [(e["action"], e["reason"], e["actor"]) for e in entries] == [
            ("delete", "retired", OPS),
            ("revoke", "runaway", OPS),
            ("set_capacity", "more disks", OPS),
            ("create", "new pool", OPS),
        ]
        # A client token reads the log, but not the key of a lease that is not its own... and alice's is hers.
        seen = alice.get("/v1/admin-log", params={"name": name}).json()["entries"]
        assert seen[1]["key"] == lease["key"]
        with _http(service, BOB) as bob:
            assert bob.get("/v1/admin-log", params={"name": name}).json()["entries"][1]["key"] is None
        # The capacity history has the same change, in its own words.
        history = admin.get(f"/v1/capacity-history/{name}").json()["changes"]
        assert (history[0]["old_capacity"], history[0]["new_capacity"], history[0]["reason"]) == (1, 4, "more disks")


def test_a_forced_delete_of_a_held_semaphore_is_logged_with_what_it_revoked(service: Service, ns: str) -> None:
    """The delete ends the leases on the semaphore in a transaction of its own first (lock order: see
    flows.delete_semaphore); its record still goes with the delete. It was lost: the action went on in the
    next transaction without its log entry."""
    name = f"{ns}forced"
    with _http(service) as admin, _http(service, ALICE) as alice:
        admin.post("/v1/semaphores", json={"name": name, "capacity": 2})
        alice.post("/v1/leases", json={"wants": {name: 1}, "ttl": 60})
        alice.post("/v1/leases", json={"wants": {name: 1}, "ttl": 60})
        deleted = admin.delete(f"/v1/semaphores/{name}", params={"reason": "retired", "force": "true"})
        assert deleted.status_code == 200, deleted.text
        entries = admin.get("/v1/admin-log", params={"name": name}).json()["entries"]
        assert [(e["action"], e["reason"]) for e in entries if e["action"] == "delete"] == [("delete", "retired")]


def test_a_failed_admin_action_leaves_no_log_entry(service: Service, ns: str) -> None:
    name = f"{ns}nolog"
    with _http(service) as admin:
        assert admin.patch(f"/v1/semaphores/{name}", json={"capacity": 4, "reason": "typo"}).status_code == 404
        assert admin.get("/v1/admin-log", params={"name": name}).json()["entries"] == []
        admin.post("/v1/semaphores", json={"name": name, "capacity": 1})
        for blank in ("", " "):
            refused = admin.patch(f"/v1/semaphores/{name}", json={"capacity": 4, "reason": blank})
            assert refused.status_code == 422 and refused.json()["error"]["details"]["field"] == "reason"
        assert [e["action"] for e in admin.get("/v1/admin-log", params={"name": name}).json()["entries"]] == ["create"]


def test_a_create_that_found_the_semaphore_there_is_not_recorded(service: Service, ns: str) -> None:
    """``exist_ok`` answers with the semaphore that was there: it created nothing, so the log says nothing
    was; a create refused as a conflict (another capacity) leaves no entry either."""
    name = f"{ns}again"
    with _http(service) as admin:
        for _ in range(3):
            made = admin.post("/v1/semaphores", json={"name": name, "capacity": 2, "exist_ok": True})
            assert made.status_code == 201, made.text
        clash = admin.post("/v1/semaphores", json={"name": name, "capacity": 3, "exist_ok": True})
        assert clash.status_code == 409 and clash.json()["error"]["code"] == "semaphore_exists"
        entries = admin.get("/v1/admin-log", params={"name": name}).json()["entries"]
        assert [(e["action"], e["detail"]) for e in entries] == [("create", "capacity 2")]


def test_revoking_a_lease_that_had_ended_is_not_recorded_as_a_revoke(service: Service, ns: str) -> None:
    """It is answered with the lease unchanged: nothing was done, so the log says nothing was."""
    name = f"{ns}ended"
    with _http(service) as admin, _http(service, ALICE) as alice:
        admin.post("/v1/semaphores", json={"name": name, "capacity": 1})
        lease = alice.post("/v1/leases", json={"wants": {name: 1}, "ttl": 60}).json()
        owner = alice.get(f"/v1/holders/{name}").json()["holders"][0]["owner"]
        assert alice.post("/v1/leases/release", json={"key": lease["key"]}).status_code == 200
        for _ in range(2):
            answer = admin.post("/v1/leases/revoke", json={"key": lease["key"], "owner": owner, "reason": "runaway"})
            assert answer.status_code == 200 and answer.json()["end_reason"] == "released"
        entries = admin.get("/v1/admin-log", params={"name": name}).json()["entries"]
        assert [e["action"] for e in entries] == ["create"]


def test_the_event_feed_polls_and_streams_grants_endings_and_changes(service: Service, ns: str) -> None:
    name = f"{ns}feed"
    with _http(service) as admin, _http(service, ALICE) as alice:
        admin.post("/v1/semaphores", json={"name": name, "capacity": 2})
        cursor = alice.get("/v1/events").json()["cursor"]
        received: list[dict[str, Any]] = []
        ready = threading.Event()

        def listen() -> None:
            with httpx.Client(base_url=service.url, timeout=30) as http:
                headers = {"Authorization": f"Bearer {BOB}"}
                with http.stream("GET", "/v1/events/stream", params={"since": cursor}, headers=headers) as stream:
                    assert stream.headers["content-type"].startswith("text/event-stream")
                    ready.set()
                    for line in stream.iter_lines():
                        if line.startswith("data: "):
                            received.append(json.loads(line[6:]))
                        kinds = {e["type"] for e in received if name in e.get("names", [])}
                        if kinds >= {"grant", "end", "capacity", "admin"}:
                            return

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        assert ready.wait(20)
        lease = alice.post("/v1/leases", json={"wants": {name: 1}, "ttl": 60}).json()
        alice.post("/v1/leases/release", json={"key": lease["key"]})
        admin.patch(f"/v1/semaphores/{name}", json={"capacity": 3, "reason": "feed test"})
        listener.join(30)
        mine = [e for e in received if name in e.get("names", [])]
        kinds = [e["type"] for e in mine]
        assert "grant" in kinds and "end" in kinds and "capacity" in kinds and "admin" in kinds, kinds
        grant = next(e for e in mine if e["type"] == "grant")
        assert grant["permits"] == [{"name": name, "count": 1, "token": lease["tokens"][name]}]
        assert grant["key"] is None  # bob sees alice's lease, not its key
        end = next(e for e in mine if e["type"] == "end")
        assert end["reason"] == "released" and end["lease_id"] == grant["lease_id"]
        # Polling from the same cursor gives the same events, with alice's key shown to alice.
        polled = alice.get("/v1/events", params={"since": cursor}).json()
        assert any(e["type"] == "grant" and e["key"] == lease["key"] for e in polled["events"])
        assert alice.get("/v1/events", params={"since": "nonsense"}).status_code == 422


def _stream_events(
    service: Service, since: str, name: str, until: set[str], seconds: float
) -> tuple[list[dict[str, Any]], threading.Thread]:
    """Open a stream at ``since`` on a thread: the list it fills with the events about ``name``, until it has
    had every type in ``until`` (or ``seconds`` have passed), and the thread."""
    received: list[dict[str, Any]] = []
    ready = threading.Event()

    def listen() -> None:
        with httpx.Client(base_url=service.url, timeout=seconds + 10) as http:
            headers = {"Authorization": f"Bearer {ADMIN}"}
            with http.stream("GET", "/v1/events/stream", params={"since": since}, headers=headers) as stream:
                ready.set()
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        if name in event.get("names", []):
                            received.append(event)
                    if {e["type"] for e in received} >= until:
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert ready.wait(20)
    return received, listener


def test_a_stream_opened_when_none_is_open_starts_at_its_own_cursor(service: Service, ns: str) -> None:
    """The instance's poller stops with its last stream and keeps its place. A page opened later, with
    nothing else open, gets what happened after its own cursor, and nothing from before it: not the changes
    made while no page was open (the poller's old place), nor any event twice. Every event carries its id."""
    name = f"{ns}gap"
    with _http(service) as admin:
        admin.post("/v1/semaphores", json={"name": name, "capacity": 2})
        first, listener = _stream_events(service, admin.get("/v1/events").json()["cursor"], name, {"capacity"}, 20)
        admin.patch(f"/v1/semaphores/{name}", json={"capacity": 3, "reason": "while the first page is open"})
        listener.join(30)
        assert [e["new_capacity"] for e in first if e["type"] == "capacity"] == [3], first
        # The first stream is closed now; the poller stops. Changes while no page is open:
        time.sleep(1.0)
        admin.patch(f"/v1/semaphores/{name}", json={"capacity": 4, "reason": "while no page is open"})
        cursor = admin.get("/v1/events").json()["cursor"]
        second, listener = _stream_events(service, cursor, name, {"capacity", "grant"}, 20)
        admin.patch(f"/v1/semaphores/{name}", json={"capacity": 5, "reason": "while the second page is open"})
        lease = admin.post("/v1/leases", json={"wants": {name: 1}, "ttl": 60}).json()
        listener.join(30)
        admin.post("/v1/leases/release", json={"key": lease["key"]})
        changes = [e for e in second if e["type"] == "capacity"]
        assert [e["new_capacity"] for e in changes] == [5], second
        assert all(isinstance(e["change_id"], int) for e in changes)
        grants = [e for e in second if e["type"] == "grant"]
        assert [g["permits"][0]["token"] for g in grants] == [lease["tokens"][name]], second
        admins = [e for e in second if e["type"] == "admin"]
        assert admins and all(isinstance(e["admin_id"], int) for e in admins), second


def test_a_cursor_past_the_database_does_not_blind_the_pages_that_join_later(service: Service, ns: str) -> None:
    """A stream opened with a cursor ahead of everything in the database (any caller can send one; a
    restored database can be behind a page's cursor), while no other stream is open on the instance: the
    instance's feed position stays at the database's head, so a page that joins later still gets what
    happens next, and so does the first."""
    name = f"{ns}ahead"
    top = 2**63 - 1
    with _http(service) as admin:
        admin.post("/v1/semaphores", json={"name": name, "capacity": 2})
        time.sleep(0.5)  # the streams of the tests before have closed
        first, first_listener = _stream_events(service, f"g{top}.e{top}.c{top}.a{top}", name, {"capacity"}, 20)
        cursor = admin.get("/v1/events").json()["cursor"]
        second, second_listener = _stream_events(service, cursor, name, {"capacity"}, 20)
        admin.patch(f"/v1/semaphores/{name}", json={"capacity": 3, "reason": "after both pages opened"})
        second_listener.join(30)
        first_listener.join(30)
        assert [e["new_capacity"] for e in second if e["type"] == "capacity"] == [3], second
        assert [e["new_capacity"] for e in first if e["type"] == "capacity"] == [3], first


def test_nothing_is_readable_without_a_token(service: Service, ns: str) -> None:
    with _http(service, None) as anonymous:
        for path in (
            "/v1/overview",
            f"/v1/stats/{ns}x",
            f"/v1/endings/{ns}x",
            "/v1/admin-log",
            "/v1/events",
            "/metrics",
        ):
            assert anonymous.get(path).status_code == 401, path
        page = anonymous.get("/")
        assert page.status_code == 200 and "/ui/dashboard.js" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert anonymous.get("/ui/dashboard.css").status_code == 200
        assert anonymous.get("/ui/..%2Fapp.py").status_code == 404
    with _http(service) as admin:
        assert admin.get("/metrics").status_code == 200


def test_charts_outlive_the_instance_that_drew_them(db: str, service: Service, ns: str) -> None:
    name = f"{ns}restart"
    with _http(service) as admin:
        admin.post("/v1/semaphores", json={"name": name, "capacity": 1})
        admin.post("/v1/leases", json={"wants": {name: 1}, "ttl": 60})
        wait_until(lambda: _charted(admin, name), timeout=15)
    quiet = {**FAST, "PERMITS_MAINTENANCE__ENABLED": "false"}
    with running(db, tokens=TOKENS, env=quiet) as fresh, _http(fresh) as admin:
        assert _charted(admin, name)
        assert any(u is not None for u in _row(admin.get("/v1/overview").json(), name)["util"])


def _charted(client: httpx.Client, name: str) -> bool:
    points = client.get(f"/v1/stats/{name}", params={"minutes": 2}).json()["points"]
    return any(p["util"] is not None for p in points)
