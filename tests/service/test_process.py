"""``permits serve`` as a process: graceful shutdown, the CLI pointed at a service, open mode's bind rule,
the OpenAPI document, and several instances on one database."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import permits
from tests._children import run_take_turns
from tests._proxy import CuttingProxy
from tests._service import Service, metric, running, wait_until


def test_shutdown_answers_waiters_and_lets_requests_finish(sqlite_url: str, ns: str) -> None:
    service = Service(sqlite_url, env={"PERMITS_MAINTENANCE__ENABLED": "false"})
    try:
        with permits.connect(service.url) as client:
            client.create_semaphore(f"{ns}s", 1)
            client.acquire(f"{ns}s", ttl=60)
            answers: list[httpx.Response] = []

            def wait_for_room() -> None:
                with httpx.Client(base_url=service.url, timeout=60) as http:
                    answers.append(http.post("/v1/leases", json={"wants": {f"{ns}s": 1}, "wait": 50}))

            waiter = threading.Thread(target=wait_for_room)
            waiter.start()
            wait_until(lambda: metric(service, "permits_waiters") == 1)
            asked_at = time.monotonic()
            service.process.terminate()
            waiter.join(20)
            assert answers, "the waiter got no answer"
            answered_after = time.monotonic() - asked_at
        assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "service_unavailable"
        assert answers[0].headers["Retry-After"] == "1"
        assert answered_after < 5, answered_after
        # uvicorn finishes its graceful shutdown, then ends by the signal it was sent, as systemd expects.
        assert service.process.wait(20) in (0, -15), service.log()
        assert "Application shutdown complete" in service.log()
    finally:
        service.stop()


def test_shutdown_ends_the_live_event_streams_at_once(sqlite_url: str) -> None:
    """A dashboard left open must not hold a stopping instance up for the whole grace: its event stream ends
    when the signal arrives (the page reconnects to another instance from its cursor)."""
    # Maintenance off: its work would show in the feed, and any event also ended the stream before.
    service = Service(sqlite_url, env={"PERMITS_SHUTDOWN_GRACE": "60", "PERMITS_MAINTENANCE__ENABLED": "false"})
    try:
        with httpx.Client(base_url=service.url, timeout=60) as http, http.stream("GET", "/v1/events/stream") as feed:
            assert feed.status_code == 200
            lines = feed.iter_lines()
            assert next(lines) == ": connected"
            signalled = time.monotonic()
            service.process.terminate()
            rest = list(lines)  # until the server ends the stream
        assert service.process.wait(30) in (0, -15), service.log()
        stopped_after = time.monotonic() - signalled
        assert stopped_after < 5, (stopped_after, rest, service.log())  # not the 60 s grace
        assert "Application shutdown complete" in service.log()
    finally:
        service.stop()


def test_cli_commands_accept_a_service_url(sqlite_url: str, ns: str) -> None:
    with running(sqlite_url) as service:
        env = {**os.environ, "PERMITS_DATABASE_URL": service.url}

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "permits", *args], env=env, capture_output=True, text=True)

        assert cli("sem", "create", f"{ns}job", "--capacity", "1").returncode == 0
        listed = cli("sem", "ls", "--prefix", ns, "--json")
        assert [s["name"] for s in json.loads(listed.stdout)] == [f"{ns}job"]
        run = cli("run", f"{ns}job", "--timeout", "5", "--", sys.executable, "-c", "print('ran under the lease')")
        assert run.returncode == 0 and "ran under the lease" in run.stdout
        lease = json.loads(cli("acquire", f"{ns}job", "--key", "k1").stdout)
        assert lease["counts"] == {f"{ns}job": 1} and isinstance(lease["tokens"][f"{ns}job"], int)
        busy = cli("run", f"{ns}job", "--timeout", "0", "--", "true")
        assert busy.returncode == 75
        assert cli("release", "k1").stdout.strip() == "released"
        upgrade = cli("db", "upgrade")
        assert upgrade.returncode == 1 and "permits db upgrade --db DATABASE_URL" in upgrade.stderr


def test_open_mode_refuses_to_listen_beyond_loopback(sqlite_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "permits", "serve", "--db", sqlite_url, "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PERMITS_TOKENS"},
    )
    assert done.returncode == 2
    assert "no tokens are configured" in done.stderr and "loopback" in done.stderr


def test_bad_config_is_a_clear_error(tmp_path: Path, sqlite_url: str) -> None:
    config = tmp_path / "permits.toml"
    config.write_text('[[tokens]]\nname = "has/slash"\ntoken = "0123456789abcdef"\n')
    done = subprocess.run(
        [sys.executable, "-m", "permits", "serve", "--db", sqlite_url, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "bad setting tokens" in done.stderr, done.stderr


def test_openapi_document_describes_every_route(sqlite_url: str) -> None:
    with running(sqlite_url) as service:
        document = httpx.get(f"{service.url}/openapi.json").json()
        for path in ("/healthz", "/readyz", "/metrics"):  # refused on every path, as the document says below
            twice = httpx.get(f"{service.url}{path}?a=1&a=2")
            assert (twice.status_code, twice.json()["error"]["code"]) == (422, "invalid_argument"), path
    paths = document["paths"]
    for path in (
        "/v1/leases",
        "/v1/leases/release",
        "/v1/leases/extend",
        "/v1/leases/revoke",
        "/v1/leases/{key}",
        "/v1/semaphores",
        "/v1/semaphores/{name}",
        "/v1/holders/{name}",
        "/v1/capacity-history/{name}",
        "/v1/sweep",
        "/v1/reconcile",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in paths, path
    token = document["components"]["schemas"]["LeaseOut"]["properties"]["tokens"]
    assert token["additionalProperties"]["type"] == "string"
    # Every 429 and 503 carries Retry-After, and the document says so (a generated client can honour it);
    # readiness declares its 503.
    declared = [
        (path, method, status, answer)
        for path, item in paths.items()
        for method, operation in item.items()
        for status, answer in operation["responses"].items()
        if status in ("429", "503")
    ]
    assert ("/readyz", "get", "503") in {(p, m, s) for p, m, s, _ in declared}
    assert len(declared) > 20
    for path, method, status, answer in declared:
        assert answer["headers"]["Retry-After"]["required"] is True, (path, method, status)
    # A query parameter given twice is refused on every path, and every operation says so.
    for path, item in paths.items():
        for method, operation in item.items():
            assert "422" in operation["responses"], (method, path)
    # Each operation lists the error statuses it may answer with, not every one the API has (routes.py):
    # what a generated client handles, and what schemathesis and the bad-input table hold the answers to.
    errors = {
        f"{method.upper()} {path}": sorted(int(s) for s in operation["responses"] if s[0] in "45")
        for path, item in paths.items()
        if path.startswith("/v1/")
        for method, operation in item.items()
    }
    assert errors["GET /v1/whoami"] == [401, 422]
    assert errors["POST /v1/leases"] == [401, 404, 409, 410, 413, 422, 429, 503]
    assert errors["POST /v1/leases/release"] == [401, 413, 422, 503]
    assert errors["POST /v1/leases/extend"] == [401, 404, 410, 413, 422, 503]
    assert errors["DELETE /v1/semaphores/{name}"] == [401, 403, 404, 409, 413, 422, 503]
    assert errors["GET /v1/semaphores"] == [401, 422, 503]
    for operation, statuses in errors.items():
        method, path = operation.split(" ")
        assert 401 in statuses and 422 in statuses, operation
        assert (413 in statuses) == (method != "GET"), operation  # a GET's body: a 422 (body.Route), never a 413
        admin_only = paths[path][method.lower()]["tags"] == ["admin"] or (
            method != "GET" and path.startswith("/v1/semaphores")
        )
        assert (403 in statuses) == admin_only, operation
        assert (429 in statuses) == (operation in ("POST /v1/leases", "GET /v1/events/stream")), operation


@pytest.mark.parametrize("server", ["mysql", "postgresql"])
def test_several_instances_serve_one_database(servers: Any, ns: str, server: str) -> None:
    db_url = servers.url_for(server).render_as_string(hide_password=False)
    with (
        running(db_url) as first,
        running(db_url) as second,
        permits.connect(first.url) as a,
        permits.connect(second.url) as b,
    ):
        a.create_semaphore(f"{ns}s", 2)
        held = [a.acquire(f"{ns}s", ttl=30), b.acquire(f"{ns}s", ttl=30)]
        assert a.try_acquire(f"{ns}s") is None and b.try_acquire(f"{ns}s") is None
        # A waiter on one instance finds room released through the other (by polling).
        waiter: list[Any] = []
        thread = threading.Thread(target=lambda: waiter.append(b.acquire(f"{ns}s", ttl=30, timeout=20)))
        thread.start()
        time.sleep(0.3)
        a.release(held[0])
        thread.join(25)
        assert waiter and waiter[0].token > held[1].token
        assert sorted(h.key for h in a.holders(f"{ns}s")) == sorted([held[1].key, waiter[0].key])


@pytest.mark.alone  # six processes timed against each other: with the machine to itself (tests/conftest.py)
def test_waiters_on_a_mutex_take_turns_through_the_service(db_url: str, ns: str) -> None:
    """Six processes share a mutex through one instance: none times out, and they get about equal turns.

    Before the hand-off, a waiter that lost two races to others polled with a backoff of up to a second,
    and at eight waiters some timed out after 5 s while one took nearly every turn."""
    with running(db_url, env={"PERMITS_MAINTENANCE__ENABLED": "false"}) as service:
        with permits.connect(service.url) as admin:
            admin.create_semaphore(f"{ns}m", 1)
        args = {"url": service.url, "name": f"{ns}m", "seconds": 4, "hold": 0.02, "timeout": 3}
        results = run_take_turns(6, args)
        with permits.connect(service.url) as admin:
            assert admin.get_semaphore(f"{ns}m").used == 0
    turns = [r["granted"] for r in results]
    assert all(r["timed_out"] == 0 for r in results), results
    assert min(turns) > 0, results
    jain = sum(turns) ** 2 / (len(turns) * sum(t * t for t in turns))
    assert jain >= 0.9, (jain, results)


def test_serve_without_a_database_says_so_and_exits(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "permits", "serve", "--db", "mysql://root@127.0.0.1:1/nothing", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    assert "permits: storage_unavailable: database unavailable at mysql://root@127.0.0.1:1/nothing" in done.stderr
    assert "Traceback" not in done.stderr


def test_metrics_count_what_happened(sqlite_url: str, ns: str) -> None:
    with running(sqlite_url, env={"PERMITS_MAINTENANCE__ENABLED": "false"}) as service:
        with permits.connect(service.url) as client:
            client.create_semaphore(f"{ns}m", 2)
            held = client.acquire(f"{ns}m", ttl=60)
            client.acquire(f"{ns}m", ttl=60)
            assert client.try_acquire(f"{ns}m") is None
            with pytest.raises(permits.AcquireTimeout):
                client.acquire(f"{ns}m", timeout=0.3)
            # A caller's mistakes are "rejected", never "error", which an operator alerts on.
            with pytest.raises(permits.SemaphoreNotFound):
                client.acquire(f"{ns}missing", timeout=1)
            with pytest.raises(permits.CountExceedsCapacity):
                client.acquire({f"{ns}m": 3}, timeout=1)
            client.release(held)
        wait_until(lambda: metric(service, f'permits_semaphore_leases{{semaphore="{ns}m"}}') == 1.0, timeout=15)
        assert metric(service, 'permits_acquire_total{outcome="granted"}') == 2
        assert metric(service, 'permits_acquire_total{outcome="refused"}') == 1
        assert (metric(service, 'permits_acquire_total{outcome="timeout"}') or 0) >= 1
        assert metric(service, 'permits_acquire_total{outcome="rejected"}') == 2
        assert (metric(service, 'permits_acquire_total{outcome="error"}') or 0) == 0
        assert metric(service, 'permits_release_total{outcome="released"}') == 1
        assert metric(service, "permits_hold_seconds_count") == 1
        assert metric(service, f'permits_semaphore_capacity{{semaphore="{ns}m"}}') == 2
        assert metric(service, f'permits_semaphore_used{{semaphore="{ns}m"}}') == 1
        assert metric(service, 'permits_http_requests_total{route="/v1/leases",status="201"}') == 2


def test_the_printed_url_answers_with_the_dashboard(sqlite_url: str, ns: str) -> None:
    with running(sqlite_url) as service:
        with permits.connect(service.url) as client:
            client.create_semaphore(f"{ns}<b>", 3)
        page = httpx.get(service.url + "/")
        overview = httpx.get(service.url + "/v1/overview").json()
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "permits" in page.text and 'href="/docs"' in page.text and "/ui/dashboard.js" in page.text
    # The page is a shell: every name reaches it as JSON, and the script writes names as text, never HTML.
    assert f"{ns}<b>" not in page.text
    assert f"{ns}<b>" in [s["name"] for s in overview["semaphores"]]
    assert "sqlite:" not in page.text  # no database URL in any answer


def test_openapi_document_states_this_instances_limits(sqlite_url: str) -> None:
    """The document is this instance's: its limits, and with tokens the owners that fit under an identity,
    so that a request it calls valid is not refused (tests/service/test_schemathesis.py checks it all)."""
    from permits.server.auth import SCOPED_OWNER_LENGTH

    tokens = [{"name": "ops", "token": "limits-admin-0123456789", "admin": True}]
    env = {"PERMITS_LIMITS__MAX_WANTS": "3", "PERMITS_LIMITS__MAX_TTL": "60", "PERMITS_LIMITS__MAX_WAIT": "5"}
    with running(sqlite_url, tokens=tokens, env=env) as service:
        document = httpx.get(f"{service.url}/openapi.json").json()
        wrong_method = httpx.put(f"{service.url}/v1/semaphores/anything")
    bodies = document["components"]["schemas"]
    acquire = bodies["AcquireIn"]["properties"]
    assert [b.get("maxItems", b.get("maxProperties")) for b in acquire["wants"]["oneOf"]] == [3, 3]
    assert [b["maximum"] for b in acquire["ttl"]["anyOf"] if b.get("type") == "number"] == [60]
    assert acquire["wait"]["maximum"] == 5
    assert [b["maxLength"] for b in acquire["owner"]["anyOf"] if b.get("type") == "string"] == [SCOPED_OWNER_LENGTH]
    assert SCOPED_OWNER_LENGTH == 190  # docs/service.md says so
    # A revoke names the owner as stored, prefix and all: the library's limit.
    assert bodies["RevokeIn"]["properties"]["owner"]["maxLength"] == 255
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert set(wrong_method.headers["allow"].split(", ")) >= {"GET", "PATCH", "DELETE"}


def test_no_expiry_the_service_sets_is_beyond_its_max_ttl(db_url: str, ns: str) -> None:
    """``limits.max_ttl`` bounds every expiry the service sets, not only the TTLs it is asked for: its default
    TTL, and an extend without a TTL of a lease whose own TTL is longer (one a library client granted, here
    600 s). The lease keeps its own TTL, for extends that do not go through this service."""
    name = f"{ns}bounded"
    with (
        running(db_url, env={"PERMITS_LIMITS__MAX_TTL": "30"}) as service,
        permits.connect(service.url, owner=f"{ns}web") as web,
        permits.connect(db_url, owner=f"{ns}lib") as lib,
    ):
        web.create_semaphore(name, 2)
        assert web.default_ttl == 30 and lib.default_ttl == 60
        assert httpx.get(f"{service.url}/v1/whoami").json()["limits"]["default_ttl"] == 30
        defaulted = web.acquire(name)
        assert defaulted.ttl == 30 and 25 < defaulted.expires_in <= 30
        web.release(defaulted)  # else what follows waits for it to run out
        with permits.connect(service.url, ttl=60) as chose, pytest.raises(permits.InvalidArgument, match="at most 30"):
            chose.acquire(name)  # a TTL the caller chose is not cut short behind its back
        long_lived = lib.acquire(name, ttl=600)
        assert long_lived.ttl == 600
        extended = web.extend(long_lived.key, owner=f"{ns}lib")
        assert extended.ttl == 600 and 25 < extended.expires_in <= 30
        assert 15 < web.extend(long_lived.key, 20, owner=f"{ns}lib").expires_in <= 20
        with pytest.raises(permits.InvalidArgument, match="ttl is at most 30 s"):
            web.extend(long_lived.key, 31, owner=f"{ns}lib")
        assert 590 < lib.extend(long_lived).expires_in <= 600  # the library is not bound by the service
        with web.lease(name) as held:
            assert held.ttl == 30
        with web.mutex(name, max_hold=10) as held:
            assert held.ttl == 10
        run = [sys.executable, "-m", "permits", "run", "--db", service.url, name, "--", sys.executable, "-c", "pass"]
        assert subprocess.run(run, capture_output=True, text=True, timeout=60).returncode == 0


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_request_for_a_new_lease_only_whose_reply_is_lost_is_sent_again_and_gets_its_lease(
    db_url: str, ns: str
) -> None:
    """A ``new_only`` acquire whose reply is lost after the service granted it: the client sends it again,
    with the same ``request_id``, and the service answers with the lease the first try got, as its own, not
    with 409 ``key_in_use``. Granted once."""
    name, key = f"{ns}once", f"{ns}job"
    with (
        running(db_url) as service,
        CuttingProxy(("127.0.0.1", int(service.url.rsplit(":", 1)[1].rstrip("/")))) as proxy,
        permits.connect(f"http://127.0.0.1:{proxy.port}", retries=3) as client,
        permits.connect(db_url) as direct,
    ):
        direct.create_semaphore(name, 1)
        client.get_semaphore(name)  # the client's connection to the service is open
        connections = proxy.connections
        proxy.cut_after_server_bytes(0)  # the acquire is answered, and the answer's first byte cut
        lease = client.acquire(name, key=key, new_only=True, timeout=5)
        proxy.heal()
        assert proxy.connections > connections, "the acquire was not sent again"
        stored = direct.get_lease(key, owner=lease.owner)
        assert stored.held and lease.tokens == stored.tokens
        assert direct.get_semaphore(name).used == 1 and len(direct.holders(name)) == 1
        # Both tries were answered with the lease: the first one's reply was lost, not its request.
        assert metric(service, 'permits_acquire_total{outcome="granted"}') == 2


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_delete_whose_reply_is_lost_is_not_sent_again(db_url: str, ns: str) -> None:
    """The client retries a request whose connection dropped, but not a delete that may have reached the
    service: sent again, it could delete (and, forced, revoke the leases of) a semaphore created under the
    name in between. The caller gets StorageUnavailable saying so, as from a database whose reply was lost.
    A delete that never left (no connection) is still retried."""
    name = f"{ns}gone"
    with (
        running(db_url) as service,
        CuttingProxy(("127.0.0.1", int(service.url.rsplit(":", 1)[1].rstrip("/")))) as proxy,
        permits.connect(f"http://127.0.0.1:{proxy.port}", retries=3) as client,
        permits.connect(db_url) as direct,
    ):
        client.create_semaphore(name, 1)  # the client's connection to the service is open
        direct.acquire(name, ttl=30)
        connections = proxy.connections
        proxy.cut_after_client_packets(1)  # the DELETE reaches the service; no reply comes back
        with pytest.raises(permits.StorageUnavailable, match="may have been carried out"):
            client.delete_semaphore(name, force=True)
        proxy.heal()
        assert proxy.connections == connections, "the delete was sent again"
        # Carried out or not, the outcome is the service's: asked again, the caller finds out.
        with contextlib.suppress(permits.SemaphoreNotFound):
            assert client.delete_semaphore(name, force=True) in (0, 1)
        with pytest.raises(permits.SemaphoreNotFound):
            direct.get_semaphore(name)


def test_the_service_says_how_long_past_a_wait_it_may_take_and_its_clients_wait_that_long(db_url: str) -> None:
    """``limits.answer_grace``: its pre-lock wait and its store's least wait for a database's answer (two
    lock waits and 5 s). A client over a link that hangs gives up that long after its timeout, and waits at
    least that long for each answer (``permits._deadline``); a fixed 25 s would cut a healthy service
    configured with longer waits."""
    env = {"PERMITS_PRELOCK_WAIT": "4", "PERMITS_LOCK_WAIT_TIMEOUT": "8"}
    with running(db_url, env=env) as service, permits.connect(service.url) as web:
        assert httpx.get(f"{service.url}/v1/whoami").json()["limits"]["answer_grace"] == 4 + 2 * 8 + 5
        web.ping()
        web.list_semaphores("")
        assert web._store._grace == 4 + 2 * 8 + 5  # type: ignore[attr-defined]
