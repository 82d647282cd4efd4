"""A real ``permits serve`` process with tokens: who may do what, error bodies, limits and tokens on the
wire. One service per backend for the module; every test keeps to its own semaphores (``ns``)."""

from __future__ import annotations

import hashlib
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import permits
from tests._proxy import CuttingProxy
from tests._service import Service, module_db_url, running
from tests.conftest import sqlalchemy_url

ADMIN, ALICE, BOB = "admin-token-0123456789", "alice-token-0123456789", "bob-token-012345678901"
CAROL, DAVE = "carol-token-0123456789", "dave-token-01234567890"
# Identities of their own in this run: the servers' databases are shared by the whole session, and other
# tests hold leases under owners such as "alice".
RUN = uuid.uuid4().hex[:6]
OPS, ALICE_ID, BOB_ID, CAROL_ID = f"ops-{RUN}", f"alice-{RUN}", f"bob-{RUN}", f"carol-{RUN}"
DAVE_ID = f"dave-{RUN}"
TOKENS = [
    {"name": OPS, "token": ADMIN, "admin": True},
    {"name": ALICE_ID, "token": ALICE},
    # A token may be configured by its SHA-256 alone, to keep the secret out of the config.
    {"name": BOB_ID, "token_sha256": hashlib.sha256(BOB.encode()).hexdigest()},
    {"name": CAROL_ID, "token": CAROL},
    {"name": DAVE_ID, "token": DAVE},
]


@pytest.fixture(scope="module", params=["sqlite", "mysql", "postgresql"])
def service(
    request: pytest.FixtureRequest, servers: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    url = module_db_url(str(request.param), servers, tmp_path_factory, "auth")
    limits = {
        "PERMITS_LIMITS__MAX_WAIT": "5",
        "PERMITS_LIMITS__MAX_WANTS": "3",
        "PERMITS_LIMITS__MAX_TTL": "3600",
        "PERMITS_LIMITS__MAX_LEASES_PER_CLIENT": "3",
        "PERMITS_LIMITS__MAX_WAITERS": "2",
        "PERMITS_LIMITS__MAX_BODY_BYTES": "4096",
        "PERMITS_MAINTENANCE__ENABLED": "false",
    }
    with running(url, tokens=TOKENS, env=limits) as svc:
        yield svc


def _http(service: Service, token: str | None) -> httpx.Client:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.Client(base_url=service.url, headers=headers, timeout=30)


def _error(response: httpx.Response) -> tuple[int, str]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}, body
    return response.status_code, body["error"]["code"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/whoami"),
        ("GET", "/v1/semaphores"),
        ("POST", "/v1/leases"),
        ("POST", "/v1/leases/release"),
        ("POST", "/v1/leases/give-up"),
        ("GET", "/v1/leases/some-key"),
        ("GET", "/v1/holders/x"),
        ("DELETE", "/v1/semaphores/x"),
    ],
)
def test_no_token_or_a_wrong_one_is_401(service: Service, method: str, path: str) -> None:
    for token in (None, "not-a-token-at-all-00000"):
        with _http(service, token) as http:
            response = http.request(method, path, json={})
        assert _error(response) == (401, "unauthorized")
        assert response.headers["WWW-Authenticate"] == 'Bearer realm="permits"'
    with _http(service, None) as http:
        response = http.get("/v1/whoami", headers={"Authorization": f"Basic {ALICE}"})
        assert _error(response) == (401, "unauthorized")
        assert response.headers["WWW-Authenticate"] == 'Bearer realm="permits"'
        metrics = http.get("/metrics")
        assert metrics.status_code == 401 and metrics.headers["WWW-Authenticate"] == 'Bearer realm="permits"'


def test_live_answers_are_never_stored_by_a_cache(service: Service, ns: str) -> None:
    """Who holds what is true only now: every API answer says ``no-store``, errors and the event stream
    included; the dashboard's page keeps its own ``no-cache`` (stored, but checked before it is used)."""
    with _http(service, ALICE) as http:
        for path in ("/v1/whoami", "/v1/semaphores", f"/v1/semaphores/{ns}none", "/v1/overview", "/healthz", "/readyz"):
            response = http.get(path)
            assert response.headers.get("Cache-Control") == "no-store", (path, response.status_code)
        assert http.get("/metrics").headers.get("Cache-Control") == "no-store"
        created = http.post("/v1/leases", json={"wants": {f"{ns}none": 1}})
        assert created.headers.get("Cache-Control") == "no-store"
        with http.stream("GET", "/v1/events/stream") as feed:
            assert feed.headers.get("Cache-Control") == "no-store"
        assert http.get("/").headers.get("Cache-Control") == "no-cache"


def test_sweep_and_reconcile_take_no_body(service: Service) -> None:
    """Every field of theirs has a default: ``curl -X POST .../v1/sweep`` with a token sweeps (it was a
    422 for the missing body); without an admin token it is still refused first."""
    with _http(service, ADMIN) as http:
        swept = http.post("/v1/sweep")
        assert swept.status_code == 200 and set(swept.json()) >= {"leases"}, swept.text
        checked = http.post("/v1/reconcile")
        assert checked.status_code == 200 and "drift" in checked.json(), checked.text
        assert http.post("/v1/sweep", json={"batch_size": 0}).status_code == 422
    with _http(service, ALICE) as http:
        assert _error(http.post("/v1/sweep")) == (403, "forbidden")
    with _http(service, None) as http:
        assert _error(http.post("/v1/reconcile")) == (401, "unauthorized")


def test_wrong_token_through_the_client_raises_unauthorized(service: Service) -> None:
    with pytest.raises(permits.Unauthorized):
        permits.connect(service.url, token="not-a-token-at-all-00000").list_semaphores()
    with permits.connect(service.url, token=BOB) as bob:
        assert bob.list_semaphores("nothing-has-this-prefix") == []


def test_only_admins_manage_semaphores(service: Service, ns: str) -> None:
    with permits.connect(service.url, token=ALICE) as alice, permits.connect(service.url, token=ADMIN) as admin:
        with pytest.raises(permits.Forbidden):
            alice.create_semaphore(f"{ns}s", 2)
        admin.create_semaphore(f"{ns}s", 2)
        for attempt in (
            lambda: alice.set_capacity(f"{ns}s", 5, reason="mine now"),
            lambda: alice.delete_semaphore(f"{ns}s"),
            lambda: alice.sweep(),
            lambda: alice.reconcile(),
            lambda: alice.revoke("k", owner=OPS, reason="x"),
        ):
            with pytest.raises(permits.Forbidden):
                attempt()
        assert admin.get_semaphore(f"{ns}s").capacity == 2  # nothing changed
        change = admin.set_capacity(f"{ns}s", 3, reason="more room", who="oncall")
        assert change.changed_by == f"{OPS}/oncall"  # who did it: the identity, then what it said


def test_a_client_reaches_only_its_own_leases(service: Service, ns: str) -> None:
    with (
        permits.connect(service.url, token=ADMIN) as admin,
        permits.connect(service.url, token=ALICE, owner="worker-1") as alice,
        permits.connect(service.url, token=BOB, owner="worker-1") as bob,
    ):
        admin.create_semaphore(f"{ns}s", 5)
        lease = alice.acquire(f"{ns}s", key=f"{ns}job-7")
        assert lease.owner == "worker-1"  # shown as asked, without the identity prefix

        # Bob, with the same owner name and key, can neither see, extend nor release Alice's lease: for him
        # it does not exist, which is exactly what "not yours" must look like.
        with pytest.raises(permits.LeaseNotFound):
            bob.get_lease(f"{ns}job-7")
        with pytest.raises(permits.LeaseNotFound):
            bob.extend(f"{ns}job-7", 30)
        assert bob.release(f"{ns}job-7") == permits.ReleaseOutcome.NOT_FOUND
        assert alice.get_lease(f"{ns}job-7").held

        # Bob reusing Alice's key gets a lease of his own, never hers.
        his = bob.acquire(f"{ns}s", key=f"{ns}job-7")
        assert his.token != lease.token
        assert admin.get_semaphore(f"{ns}s").used == 2

        # The holders list shows a client the keys of its own leases only; an admin sees all.
        seen_by_bob = {h.owner: h.key for h in bob.holders(f"{ns}s")}
        assert seen_by_bob == {f"{ALICE_ID}/worker-1": "", f"{BOB_ID}/worker-1": f"{ns}job-7"}
        assert {h.key for h in admin.holders(f"{ns}s")} == {f"{ns}job-7"}

        # An admin revokes Alice's lease by its stored owner; she learns it at her next extend.
        revoked = admin.revoke(f"{ns}job-7", owner=f"{ALICE_ID}/worker-1", reason="deploy froze")
        assert revoked.end_note == f"{OPS}: deploy froze"
        with pytest.raises(permits.LeaseLost) as lost:
            alice.extend(lease, 30)
        assert lost.value.reason == "revoked"
        assert bob.release(his) == permits.ReleaseOutcome.RELEASED


def test_a_client_gives_up_only_its_own_places(service: Service, ns: str) -> None:
    """A place in a fair queue kept for a retry (``keep_place``) is under the identity's owner like a
    lease: another token naming the same owner and key gives up nothing, and the place keeps its turn."""
    name = f"{ns}fair"
    with permits.connect(service.url, token=ADMIN) as admin, _http(service, ALICE) as alice, _http(service, BOB) as bob:
        admin.create_semaphore(name, 1, fair=True)
        held = admin.acquire(name, ttl=60)
        asked = {"wants": {name: 1}, "key": f"{ns}k", "owner": "worker-1", "wait": 0.2, "keep_place": True}
        assert _error(alice.post("/v1/leases", json=asked)) == (409, "acquire_timeout")
        assert [w.owner for w in admin.waiters(name)] == [f"{ALICE_ID}/worker-1"]
        ref = {"key": f"{ns}k", "owner": "worker-1"}
        gave_up = bob.post("/v1/leases/give-up", json=ref)
        assert gave_up.status_code == 200 and gave_up.json() == {"places": 0}, gave_up.text
        assert [w.owner for w in admin.waiters(name)] == [f"{ALICE_ID}/worker-1"]
        assert alice.post("/v1/leases/give-up", json=ref).json() == {"places": 1}
        assert admin.waiters(name) == []
        admin.release(held)


def test_a_token_taken_out_of_the_config_is_refused_after_a_restart(servers: Any, ns: str) -> None:
    """Revoking a token is taking it out of the configuration and restarting. From then on it is refused,
    on every route, while the leases taken with it stay held until they expire or an admin revokes them:
    the database keeps them under the identity's owner, which no other token can act as."""
    url = servers.url_for("postgresql").render_as_string(hide_password=False)
    with running(url, tokens=TOKENS) as before:
        with permits.connect(before.url, token=ADMIN) as admin:
            admin.create_semaphore(f"{ns}s", 1)
        with permits.connect(before.url, token=CAROL, owner="nightly") as carol:
            lease = carol.acquire(f"{ns}s", key=f"{ns}backup", ttl=600)
    without_carol = [t for t in TOKENS if t["name"] != CAROL_ID]
    with running(url, tokens=without_carol) as after:
        with pytest.raises(permits.Unauthorized), permits.connect(after.url, token=CAROL):
            pass  # a client checks its token as it opens
        with _http(after, CAROL) as http:
            assert _error(http.get("/v1/whoami")) == (401, "unauthorized")
            released = http.post("/v1/leases/release", json={"key": lease.key, "owner": "nightly"})
            assert _error(released) == (401, "unauthorized")
            extended = http.post("/v1/leases/extend", json={"key": lease.key, "owner": "nightly", "ttl": 600})
            assert _error(extended) == (401, "unauthorized")
        with permits.connect(after.url, token=ADMIN) as admin:
            assert [h.owner for h in admin.holders(f"{ns}s")] == [f"{CAROL_ID}/nightly"]
            admin.revoke(f"{ns}backup", owner=f"{CAROL_ID}/nightly", reason="token revoked")
            assert admin.get_semaphore(f"{ns}s").used == 0


def test_a_body_that_is_not_json_is_refused_after_routing_and_authentication(service: Service, ns: str) -> None:
    """A body of the wrong media type is a 422, but only once the route exists and the caller is let in:
    an unknown path is still a 404, a wrong method a 405 and a missing token a 401."""
    plain = {"Content-Type": "text/plain"}
    body = '{"wants": {"x": 1}}'
    with _http(service, ADMIN) as admin, _http(service, None) as anonymous:
        assert _error(admin.post("/v1/nope", content=body, headers=plain)) == (404, "not_found")
        assert _error(admin.put("/v1/leases", content=body, headers=plain)) == (405, "method_not_allowed")
        assert _error(anonymous.post("/v1/leases", content=body, headers=plain)) == (401, "unauthorized")
        refused = admin.post("/v1/leases", content=body, headers=plain)
        assert _error(refused) == (422, "invalid_argument")
        assert refused.json()["error"]["details"] == {"field": "body"}
        assert "not text/plain" in refused.json()["error"]["message"]


#: Every admin route, with a body or parameters that are bad in every way a client could make them.
_ADMIN_ROUTES = [
    ("POST", "/v1/semaphores", {"name": "", "capacity": "many"}),
    ("PATCH", "/v1/semaphores/x", {"capacity": -1}),
    ("DELETE", "/v1/semaphores/x?force=perhaps", None),
    ("POST", "/v1/leases/revoke", {"owner": 7}),
    ("POST", "/v1/sweep", {"batch_size": "all"}),
    ("POST", "/v1/reconcile", {"repair": "yes please"}),
]


def test_a_path_with_a_trailing_slash_is_refused_naming_the_path_without_it(service: Service, ns: str) -> None:
    """``POST /v1/semaphores/`` reaches the route of one semaphore (its name empty), which takes no POST: a
    bare 405 "Method Not Allowed" sent its reader looking for a method, where the slash was the mistake.
    The refusal names the path that takes the method; nothing is created or granted. Other 404s and 405s
    say what they refused and where the API is described."""
    create = {"name": f"{ns}slash", "capacity": 1}
    with _http(service, ADMIN) as admin:
        refused = admin.post("/v1/semaphores/", json=create)
        assert _error(refused) == (405, "method_not_allowed")
        message = refused.json()["error"]["message"]
        assert message == (
            "POST /v1/semaphores/: the endpoint takes no POST; without the trailing slash, POST /v1/semaphores is one"
        )
        released = admin.post("/v1/leases/release/", json={"key": "k", "owner": "o"})
        assert _error(released) == (405, "method_not_allowed")
        assert "without the trailing slash, POST /v1/leases/release is one" in released.json()["error"]["message"]
        missing = admin.post("/v1/acquire/", json={"wants": {f"{ns}slash": 1}})
        assert missing.json()["error"] == {
            "code": "not_found",
            "message": "POST /v1/acquire/: no such endpoint (the API is described at /openapi.json)",
            "details": {},
        }
        assert admin.get(f"/v1/semaphores/{ns}slash").status_code == 404  # nothing was created
        # A route's own 404 keeps its own words.
        assert admin.get("/ui/no-such-file.js").json()["error"]["message"] == "no such dashboard file"


@pytest.mark.parametrize(("method", "path", "bad"), _ADMIN_ROUTES)
def test_who_may_ask_is_answered_before_what_was_asked(
    service: Service, method: str, path: str, bad: dict[str, Any] | None
) -> None:
    """401 (no token), then 403 (a client token on an admin route), then 422: a caller who may not ask
    learns nothing about its input, whether the input is bad JSON, a body that is not JSON, bad fields or
    bad query parameters. Only an admin is told about them."""
    broken = {"content": b'{"name": ', "headers": {"Content-Type": "application/json"}}
    plain = {"content": b"capacity=1", "headers": {"Content-Type": "text/plain"}}
    # Two the framework cannot parse at all (its 400, answered as a 422 to an admin): too deep, not UTF-8.
    deep = {"content": b"[" * 1500 + b"]" * 1500, "headers": {"Content-Type": "application/json"}}
    not_utf8 = {"content": b'{"name": "\xff"}', "headers": {"Content-Type": "application/json"}}
    shapes: list[dict[str, Any]] = [broken, plain, deep, not_utf8] + ([{"json": bad}] if bad is not None else [{}])
    with _http(service, None) as anonymous, _http(service, ALICE) as alice, _http(service, ADMIN) as admin:
        for shape in shapes:
            assert _error(anonymous.request(method, path, **shape)) == (401, "unauthorized"), shape
            assert _error(alice.request(method, path, **shape)) == (403, "forbidden"), shape
            assert _error(admin.request(method, path, **shape)) == (422, "invalid_argument"), shape


def test_bad_json_from_a_caller_without_a_token_is_401(service: Service) -> None:
    """A body that is not valid JSON is parsed before anything else runs: the caller is still asked for a
    token first, on every route that takes a body."""
    broken = {"content": b"{not json", "headers": {"Content-Type": "application/json"}}
    with _http(service, None) as anonymous, _http(service, ALICE) as alice:
        for path in ("/v1/leases", "/v1/leases/release", "/v1/leases/extend"):
            assert _error(anonymous.post(path, **broken)) == (401, "unauthorized")
            refused = alice.post(path, **broken)
            assert (
                _error(refused) == (422, "invalid_argument") and "not valid JSON" in refused.json()["error"]["message"]
            )
        # A name given twice in one object is JSON the service will not guess at, on the hot routes and off
        # them, and the message names it.
        twice = {"content": b'{"key": "a", "key": "b"}', "headers": {"Content-Type": "application/json"}}
        for path in ("/v1/leases/release", "/v1/leases/extend", "/v1/leases/give-up"):
            refused = alice.post(path, **twice)
            assert _error(refused) == (422, "invalid_argument"), path
            assert (
                refused.json()["error"]["message"]
                == "the body is ambiguous: the name 'key' appears twice in one object"
            )


def test_error_bodies_and_statuses(service: Service, ns: str) -> None:
    with _http(service, ADMIN) as http:
        assert _error(http.get(f"/v1/semaphores/{ns}nope")) == (404, "semaphore_not_found")
        assert _error(http.get("/v2/anything")) == (404, "not_found")
        assert _error(http.post("/v1/semaphores", json={"name": "", "capacity": 1})) == (422, "invalid_argument")
        assert _error(http.post("/v1/semaphores", json={"name": f"{ns}s", "capacity": "1"})) == (
            422,
            "invalid_argument",
        )
        assert _error(http.post("/v1/semaphores", json={"name": f"{ns}s", "capacity": 1, "x": 1})) == (
            422,
            "invalid_argument",
        )
        assert http.post("/v1/semaphores", json={"name": f"{ns}s", "capacity": 1}).status_code == 201
        assert _error(http.post("/v1/semaphores", json={"name": f"{ns}s", "capacity": 1})) == (409, "semaphore_exists")
        assert _error(http.post("/v1/leases", json={"wants": {f"{ns}s": 2}})) == (422, "count_exceeds_capacity")
        granted = http.post("/v1/leases", json={"wants": {f"{ns}s": 1}, "key": "k"})
        assert granted.status_code == 201
        assert _error(http.post("/v1/leases", json={"wants": {f"{ns}s": 1}})) == (409, "acquire_timeout")
        assert _error(
            http.post("/v1/leases", json={"wants": [{"name": f"{ns}s", "count": 1}], "key": "k2", "wait": 0.3})
        ) == (
            409,
            "acquire_timeout",
        )
        assert _error(http.delete(f"/v1/semaphores/{ns}s")) == (409, "semaphore_in_use")
        # A form-encoded body (curl -d without a Content-Type) is read as JSON all the same.
        done = http.post(
            "/v1/leases/release", content='{"key": "k"}', headers={"Content-Type": "application/x-www-form-urlencoded"}
        )
        assert done.json() == {"outcome": "released"}


def test_bounds_are_refused_with_a_clear_status(service: Service, ns: str) -> None:
    with _http(service, ADMIN) as http:
        for name in ("a", "b", "c", "d"):
            http.post("/v1/semaphores", json={"name": f"{ns}{name}", "capacity": 1})
        too_many = {f"{ns}{n}": 1 for n in "abcd"}
        response = http.post("/v1/leases", json={"wants": too_many})
        assert _error(response) == (422, "invalid_argument") and "at most 3" in response.json()["error"]["message"]
        assert _error(http.post("/v1/leases", json={"wants": {f"{ns}a": 1}, "wait": 6})) == (422, "invalid_argument")
        endless = http.post("/v1/leases", content=f'{{"wants": {{"{ns}a": 1}}, "wait": 1e400}}')
        assert _error(endless) == (422, "invalid_argument") and endless.json()["error"]["details"]["field"] == "wait"
        assert _error(http.post("/v1/leases", json={"wants": {f"{ns}a": 1}, "ttl": 3601})) == (422, "invalid_argument")
        big = http.post("/v1/leases", json={"wants": {f"{ns}a": 1}, "key": "x" * 5000})
        assert _error(big) == (413, "request_too_large")
    with _http(service, CAROL) as http:
        # At most 3 held leases per client on this service.
        granted = [
            http.post("/v1/leases", json={"wants": {f"{ns}{'abc'[i]}": 1}, "ttl": 60, "key": f"{ns}k{i}"})
            for i in range(3)
        ]
        assert [g.status_code for g in granted] == [201, 201, 201]
        refused = http.post("/v1/leases", json={"wants": {f"{ns}d": 1}})
        assert _error(refused) == (429, "limit_exceeded") and refused.headers["Retry-After"]
        assert refused.json()["error"]["details"]["limit"] == "max_leases_per_client"
        # A retry of a granted request (its reply lost) is no new lease: it is answered from the one it has.
        again = http.post("/v1/leases", json={"wants": {f"{ns}c": 1}, "ttl": 60, "key": f"{ns}k2"})
        assert again.status_code == 201 and again.json()["tokens"] == granted[2].json()["tokens"]
        assert _error(http.post("/v1/leases", json={"wants": {f"{ns}d": 1}, "key": f"{ns}k3"})) == (
            429,
            "limit_exceeded",
        )
        # At the bound, bad input is still bad input (422, field named), not a 429 to retry, nor a 500 from
        # looking up a key the database cannot hold.
        for body, field in (
            ({"wants": {f"{ns}d": 1}, "key": "k\u0000"}, "key"),
            ({"wants": {f"{ns}d": 1}, "owner": "o\u0000"}, "owner"),
            ({"wants": {"d\u0000": 1}}, "name"),
            ({"wants": [[f"{ns}d", 1], [f"{ns}d", 1]]}, "wants"),
        ):
            response = http.post("/v1/leases", json=body)
            assert _error(response) == (422, "invalid_argument"), (body, response.text)
            assert response.json()["error"]["details"]["field"] == field, response.text


@pytest.mark.parametrize(
    ("wants", "field", "says"),
    [
        ({"s": 0}, "wants.s", "greater than or equal to 1"),
        ({"s": "1"}, "wants.s", "valid integer"),
        ({"s": 1.5}, "wants.s", "valid integer"),
        ({"": 1}, 'wants.""', "at least 1 character"),
        ({"a.b": 0}, 'wants."a.b"', "greater than or equal to 1"),
        ([{"name": "s", "count": 0}], "wants.0.count", "greater than or equal to 1"),
        ([{"name": "s"}, {"count": 2}], "wants.1.name", "Field required"),
        (42, "wants", 'a list ([{"name": "db", "count": 1}]) or a map ({"db": 1})'),
        ("s", "wants", 'a list ([{"name": "db", "count": 1}]) or a map ({"db": 1})'),
    ],
)
def test_a_bad_want_is_described_in_the_form_it_was_sent_in(
    service: Service, wants: Any, field: str, says: str
) -> None:
    """``wants`` is a map or a list: a mistake in one is described in its own terms, never as a failure to
    be the other form, and without the validator's names for the forms."""
    with _http(service, ALICE) as http:
        response = http.post("/v1/leases", json={"wants": wants})
    assert _error(response) == (422, "invalid_argument")
    error = response.json()["error"]
    assert error["details"]["field"] == "wants"
    assert error["message"].startswith(f"{field}: ") and says in error["message"], error["message"]
    assert "list[" not in error["message"] and "dict[" not in error["message"]


def test_the_lease_bound_counts_leases_held_not_grants_made(service: Service, ns: str) -> None:
    """``max_leases_per_client`` (3 here) bounds the leases a client holds. Grants released since the
    service last counted, and retries answered from a lease the client already holds, are no leases held:
    a client that takes and gives back leases faster than that count is refreshed is never refused."""
    with _http(service, ADMIN) as http:
        http.post("/v1/semaphores", json={"name": f"{ns}s", "capacity": 10})
    with _http(service, DAVE) as http:
        for i in range(6):  # well within a second: one count of the held leases at most
            granted = http.post("/v1/leases", json={"wants": {f"{ns}s": 1}, "ttl": 60, "key": f"{ns}c{i}"})
            assert granted.status_code == 201, granted.text
            assert http.post("/v1/leases/release", json={"key": f"{ns}c{i}"}).json() == {"outcome": "released"}
        held = http.post("/v1/leases", json={"wants": {f"{ns}s": 1}, "ttl": 60, "key": f"{ns}h0"})
        for _ in range(4):  # the reply was lost, say: the same request again, answered from the same lease
            again = http.post("/v1/leases", json={"wants": {f"{ns}s": 1}, "ttl": 60, "key": f"{ns}h0"})
            assert again.status_code == 201 and again.json()["tokens"] == held.json()["tokens"], again.text
        for i in (1, 2):
            more = http.post("/v1/leases", json={"wants": {f"{ns}s": 1}, "ttl": 60, "key": f"{ns}h{i}"})
            assert more.status_code == 201, more.text
        # Three held now: the bound.
        refused = http.post("/v1/leases", json={"wants": {f"{ns}s": 1}, "ttl": 60, "key": f"{ns}h3"})
        assert _error(refused) == (429, "limit_exceeded")
        # One given back: room for one more at once, without waiting for the next count.
        assert http.post("/v1/leases/release", json={"key": f"{ns}h1"}).json() == {"outcome": "released"}
        again = http.post("/v1/leases", json={"wants": {f"{ns}s": 1}, "ttl": 60, "key": f"{ns}h3"})
        assert again.status_code == 201, again.text
        for i in (0, 2, 3):
            http.post("/v1/leases/release", json={"key": f"{ns}h{i}"})


def test_fencing_tokens_round_trip_exactly_up_to_2_63_minus_1(service: Service, servers: Any, ns: str) -> None:
    """Tokens travel as decimal strings: a JSON number would lose the last digits above 2**53."""
    with permits.connect(service.url, token=ADMIN) as admin:
        admin.create_semaphore(f"{ns}big", 1)
    top = 2**63 - 1
    db_url = _db_url_of(service)
    from sqlalchemy import create_engine, text

    engine = create_engine(sqlalchemy_url(db_url))
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE permits_semaphore SET last_token = :t WHERE name = :n"), {"t": top - 1, "n": f"{ns}big"}
        )
    engine.dispose()
    with _http(service, ADMIN) as http:
        raw = http.post("/v1/leases", json={"wants": {f"{ns}big": 1}, "key": "top", "owner": "t"}).json()
    assert raw["tokens"] == {f"{ns}big": str(top)}
    with permits.connect(service.url, token=ADMIN) as admin:
        assert admin.get_lease("top", owner="t").tokens == {f"{ns}big": top}
        assert admin.get_semaphore(f"{ns}big").last_token == top


@pytest.mark.parametrize("server", ["mysql", "postgresql"])
def test_database_outage_is_a_503_that_names_no_database(servers: Any, ns: str, server: str) -> None:
    real = servers.url_for(server)
    with CuttingProxy((real.host, real.port)) as proxy:
        via_proxy = real.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        with running(via_proxy, env={"PERMITS_MAINTENANCE__ENABLED": "false"}) as svc, _http(svc, None) as http:
            assert http.post("/v1/semaphores", json={"name": f"{ns}s", "capacity": 1}).status_code == 201
            proxy.cut_after_server_bytes(0, every=True)
            proxy.cut_all()
            response = http.post("/v1/leases", json={"wants": {f"{ns}s": 1}, "key": "k"})
            assert _error(response) == (503, "storage_unavailable")
            assert response.headers["Retry-After"] == "1"
            text_ = response.text.lower()
            assert real.host not in text_ and str(proxy.port) not in text_ and "select" not in text_
            assert _error(http.get("/readyz")) == (503, "storage_unavailable")
            proxy.heal()
            # Back: the retry with the same key is granted exactly once.
            again = http.post("/v1/leases", json={"wants": {f"{ns}s": 1}, "key": "k"})
            assert again.status_code == 201
            assert http.get(f"/v1/semaphores/{ns}s").json()["used"] == 1
            assert http.get("/readyz").json() == {"status": "ready"}


def _db_url_of(service: Service) -> str:
    args = service.process.args
    assert isinstance(args, list)
    return str(args[args.index("--db") + 1])


def test_readyz_is_not_ready_on_a_database_whose_schema_went_away(tmp_path: Path) -> None:
    """A database emptied or replaced under a running instance (restored from another backup, say) fails
    every call with schema_mismatch: readiness must say so, or a load balancer keeps sending it traffic."""
    from sqlalchemy import create_engine, text

    url = f"sqlite:///{tmp_path / 'permits.db'}"
    with running(url, env={"PERMITS_MAINTENANCE__ENABLED": "false"}) as svc, _http(svc, None) as http:
        assert http.get("/readyz").json() == {"status": "ready"}
        # A load balancer's check may send HEAD.
        assert http.head("/readyz").status_code == 200 and http.head("/healthz").status_code == 200
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text("UPDATE permits_alembic_version SET version_num = '0006'"))
        assert _error(http.get("/readyz")) == (503, "schema_mismatch")
        with engine.begin() as conn:  # a newer permits upgraded it: a rolling upgrade, and this one works on
            conn.execute(text("UPDATE permits_alembic_version SET version_num = '0999'"))
        assert http.get("/readyz").json() == {"status": "ready"}
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE permits_alembic_version"))
        assert _error(http.get("/readyz")) == (503, "schema_mismatch")
        with engine.begin() as conn:  # a database that fails the probe otherwise: not ready either, not a 500
            conn.execute(text("CREATE VIEW permits_alembic_version AS SELECT json('not json') AS version_num"))
        response = http.get("/readyz")
        assert _error(response) == (503, "storage_error"), response.text
        assert response.headers["retry-after"].isdigit()
        engine.dispose()


def test_a_path_that_is_not_utf8_is_bad_input(service: Service) -> None:
    """Decoded with U+FFFD, "%ff" would name a semaphore "\ufffd", and a DELETE would act on that one."""
    with _http(service, ADMIN) as http:
        for method, path in (("GET", "/v1/holders/%ff"), ("DELETE", "/v1/semaphores/%ED%A0%80")):
            response = http.request(method, path)
            assert _error(response) == (422, "invalid_argument"), response.text
            assert response.json()["error"]["details"]["field"] == "path"
            assert response.headers["cache-control"] == "no-store"
        assert http.get("/v1/semaphores/caf%C3%A9").status_code == 404  # UTF-8 text is a name
        for query, field in (("prefix=%ff", "prefix"), ("%ff=1", "query"), ("prefix=a&prefix=b", "prefix")):
            response = http.get(f"/v1/semaphores?{query}")
            assert _error(response) == (422, "invalid_argument"), response.text
            assert response.json()["error"]["details"]["field"] == field
        assert http.get("/v1/semaphores?prefix=caf%C3%A9&x=1").json() == {"semaphores": []}


def test_a_bad_last_event_id_is_named_as_the_header(service: Service) -> None:
    """A browser's EventSource resumes with the header, not with ``since``: the error names what was sent."""
    with _http(service, ADMIN) as http:
        response = http.get("/v1/events/stream", headers={"Last-Event-ID": "garbage"})
        assert _error(response) == (422, "invalid_argument")
        assert response.json()["error"]["details"]["field"] == "last-event-id"
        response = http.get("/v1/events/stream?since=garbage", headers={"Last-Event-ID": "garbage"})
        assert response.json()["error"]["details"]["field"] == "since"  # since= wins over the header


def test_head_answers_wherever_get_does(tmp_path: Path) -> None:
    """HTTP asks every server for HEAD wherever it has GET (RFC 9110): a monitor, a load balancer or
    ``curl -I`` gets the GET's status and headers and no body. An event stream's HEAD ends at once and
    leaves no stream behind (two HEADs with room for one stream, then the GET still gets it)."""
    url = f"sqlite:///{tmp_path / 'permits.db'}"
    env = {"PERMITS_MAINTENANCE__ENABLED": "false", "PERMITS_DASHBOARD__MAX_STREAMS": "1"}
    with running(url, env=env) as svc, _http(svc, None) as http:
        assert http.post("/v1/semaphores", json={"name": "s", "capacity": 2}).status_code == 201
        for path in ("/v1/semaphores/s", "/v1/semaphores", "/v1/holders/s", "/metrics", "/healthz", "/", "/v1/nope"):
            got, head = http.get(path), http.head(path)
            assert head.status_code == got.status_code, path
            assert head.content == b"", path
            if path != "/metrics":  # its counters count the GET just made
                assert head.headers["content-length"] == got.headers["content-length"], path
            assert head.headers["content-type"] == got.headers["content-type"], path
            assert head.headers.get("cache-control") == got.headers.get("cache-control"), path
        for _ in range(3):
            streamed = _when_a_stream_is_free(lambda: http.head("/v1/events/stream", timeout=5))
            assert streamed.status_code == 200 and streamed.content == b""
            assert streamed.headers["content-type"].startswith("text/event-stream")
        # Every HEAD let its stream go: the one stream this instance allows is free for a GET.
        deadline = time.monotonic() + 5
        while True:
            with http.stream("GET", "/v1/events/stream", timeout=5) as stream:
                if stream.status_code != 429:
                    assert stream.status_code == 200
                    assert next(stream.iter_lines()) == ": connected"
                    break
            assert time.monotonic() < deadline, "a HEAD's event stream was never let go"
            time.sleep(0.05)
        # HEAD is served, so a 405 lists it beside GET; a HEAD where GET is not allowed is still a 405.
        assert http.post("/v1/semaphores/s").headers["allow"] == "DELETE, GET, PATCH, HEAD"
        refused = http.head("/v1/sweep")
        assert refused.status_code == 405 and "GET" not in refused.headers["allow"]


def _when_a_stream_is_free(ask: Callable[[], httpx.Response]) -> httpx.Response:
    """The answer of ``ask`` once it is not a 429 for want of a free stream: a HEAD's stream ends just
    after its answer is sent, so the next request may find it still there for a moment, never for long."""
    deadline = time.monotonic() + 5
    while (answer := ask()).status_code == 429:
        assert time.monotonic() < deadline, "a HEAD's event stream was never let go"
        time.sleep(0.05)
    return answer


def test_a_body_that_asks_nothing_is_taken_where_a_route_reads_none(service: Service, ns: str) -> None:
    """Some HTTP libraries send an empty body, or ``{}``, with every request: a GET or a DELETE with one is
    answered as without it. A body with anything in it is refused (docs/bad-input.md, ``delete-body``), in
    one piece or in chunks, and names its route."""
    name = f"{ns}nobody"
    with _http(service, ADMIN) as admin:
        assert admin.post("/v1/semaphores", json={"name": name, "capacity": 1}).status_code == 201
        assert admin.request("GET", f"/v1/holders/{name}", content=b"").status_code == 200
        assert admin.request("GET", f"/v1/semaphores/{name}", content=b" {\n} ").status_code == 200
        chunked = admin.request("GET", f"/v1/holders/{name}", content=iter([b'{"owner"', b': "x"}']))
        assert _error(chunked) == (422, "invalid_argument")
        assert chunked.json()["error"]["message"].startswith("GET /v1/holders/{name} takes no body")
        assert admin.request("DELETE", f"/v1/semaphores/{name}", content=b"{}").status_code == 200
        assert admin.get(f"/v1/semaphores/{name}").status_code == 404
        # The app's own routes too: a probe's, the metrics', the API reference's.
        for path in ("/healthz", "/readyz", "/metrics", "/docs", "/redoc"):
            assert admin.request("GET", path, content=b"{}").status_code == 200, path
            refused = admin.request("GET", path, content=b'{"verbose": true}')
            assert _error(refused) == (422, "invalid_argument"), (path, refused.text)
            assert refused.json()["error"]["details"]["field"] == "body"
    # Who may ask first, then what was asked, as on the API's routes.
    with httpx.Client(base_url=service.url) as anonymous:
        assert _error(anonymous.request("GET", "/metrics", content=b'{"verbose": true}')) == (401, "unauthorized")
    # A GET's body has no size limit: one that says it is long is answered before it is sent (it was read
    # whole, before the token was checked, and 400 MB of it took 700 MB of the instance's memory).
    for token, status in ((None, "401"), (ADMIN, "422")):
        assert _answer_before_the_body(service, f"/v1/holders/{name}", token).startswith(f"HTTP/1.1 {status} ")


def _answer_before_the_body(service: Service, path: str, token: str | None) -> str:
    """The status line of a GET that says it carries 100 MB of body and sends 5 bytes of it."""
    host, port = service.url.removeprefix("http://").split(":")
    auth = "" if token is None else f"Authorization: Bearer {token}\r\n"
    head = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Length: 100000000\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head.encode() + b'{"a":')
        return conn.recv(4096).decode().partition("\r\n")[0]
