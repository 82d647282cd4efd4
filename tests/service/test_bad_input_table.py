"""docs/bad-input.md, row by row: each row of its table runs against the library on every backend and
against a real ``permits serve`` (with tokens) in front of the same database. The answer must be the one
the row gives, and nothing may change. A row this file does not know, or a case here with no row, fails."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

import permits
from permits import PermitsError, error_class
from tests._service import Service, module_db_url, running

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-input.md"
ADMIN, CLIENT = "bad-input-admin-0123456789", "bad-input-client-0123456789"
# Identities of their own: the servers' databases are shared by the whole test session.
RUN = uuid.uuid4().hex[:6]
TOKENS = [{"name": f"ops-{RUN}", "token": ADMIN, "admin": True}, {"name": f"app-{RUN}", "token": CLIENT}]
#: Was a token once; the service was never given it (see the row auth-revoked).
REVOKED = "bad-input-revoked-0123456789"


@dataclass(frozen=True)
class Row:
    case: str
    library: tuple[str, str | None] | None  # (code, field), or None: the library has no such input
    http: tuple[int, str, str | None]  # status, code, field
    changes: str


def _rows() -> list[Row]:
    rows = []
    for line in DOC.read_text().splitlines():
        if not line.startswith("| ") or line.startswith(("| case ", "| ---")):
            continue
        case, _input, library, http, changes = (c.strip() for c in line.strip("|").split(" | "))
        lib: tuple[str, str | None] | None = None
        if library != "—":
            code = re.search(r"\(`([a-z_]+)`\)", library)
            assert code, f"{case}: no (`code`) in {library!r}"
            cls = re.match(r"`(\w+)`", library)
            assert cls and error_class(code.group(1)).__name__ == cls.group(1), f"{case}: class and code disagree"
            named = re.search(r"field `(\w+)`", library)
            lib = (code.group(1), named.group(1) if named else None)
        status = re.fullmatch(r"(\d{3}) `([a-z_]+)`(?:, field `(\w+)`)?", http)
        assert status, f"{case}: cannot read the HTTP answer {http!r}"
        rows.append(Row(case, lib, (int(status.group(1)), status.group(2), status.group(3)), changes))
    return rows


ROWS = _rows()


# ------------------------------------------------------------------------------------------------ cases


@dataclass
class Ctx:
    """One row's run: ``s`` exists with capacity 2; ``job`` was granted ``{s: 1}`` on both paths; ``probe``
    is the key every refused acquire uses, and must find no lease afterwards."""

    client: Any  # the library, on the database
    service: Service
    ns: str
    s: str
    job: str
    probe: str
    owner: str

    def remote(self, token: str | None) -> permits.Client:
        return permits.connect(self.service.url, token=token)

    def fill(self, value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("{s}", self.s).replace("{job}", self.job).replace("{ns}", self.ns)
        if isinstance(value, dict):
            return {self.fill(k): self.fill(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.fill(v) for v in value)
        return value


@dataclass
class Case:
    library: Callable[[Ctx], Any] | None
    #: method, path and either a JSON value (sent with NaN and Infinity as Python writes them) or raw bytes
    http: Callable[[Ctx], tuple[str, str, Any]]
    token: str | None = ADMIN
    headers: dict[str, str] = field(default_factory=dict)


def _acquire(wants: Any, body_wants: Any = None, **options: Any) -> Case:
    """An acquire of ``wants`` (the library's form; ``body_wants`` if the JSON differs) with ``options``."""

    def library(ctx: Ctx) -> Any:
        kwargs = {"key": ctx.probe, "owner": ctx.owner, **ctx.fill(options)}
        if "timeout" in kwargs:
            return ctx.client.acquire(ctx.fill(wants), **kwargs)
        return ctx.client.try_acquire(ctx.fill(wants), **kwargs)

    def http(ctx: Ctx) -> tuple[str, str, Any]:
        body = {"wants": ctx.fill(wants if body_wants is None else body_wants), "key": ctx.probe}
        for name, value in ctx.fill(options).items():
            body["wait" if name == "timeout" else name] = value
        return "POST", "/v1/leases", body

    return Case(library, http)


@dataclass(frozen=True)
class Chunked:
    """A body sent in parts, with no Content-Length (Transfer-Encoding: chunked)."""

    parts: tuple[bytes, ...]


def _body(raw: bytes | str) -> Case:
    def http(ctx: Ctx) -> tuple[str, str, Any]:
        return "POST", "/v1/leases", ctx.fill(raw).encode() if isinstance(raw, str) else raw

    return Case(None, http)


def _as(token: str | None, library: Callable[[permits.Client, Ctx], Any], http: Callable[[Ctx], Any]) -> Case:
    def call(ctx: Ctx) -> Any:
        with ctx.remote(token) as remote:
            return library(remote, ctx)

    return Case(call, http, token=token)


def _acquire_http(ctx: Ctx) -> tuple[str, str, Any]:
    return "POST", "/v1/leases", {"wants": {ctx.s: 1}, "key": ctx.probe}


def _remote_acquire(remote: permits.Client, ctx: Ctx) -> Any:
    return remote.try_acquire(ctx.s, key=ctx.probe)


CASES: dict[str, Case] = {
    "name-empty": _acquire({"": 1}),
    "name-too-long": _acquire({"n" * 256: 1}),
    "name-nul": _acquire({"a\x00b": 1}),
    "name-lone-surrogate": _acquire({"\ud800": 1}),
    "name-not-a-string": Case(
        lambda ctx: ctx.client.create_semaphore(5, 1),
        lambda ctx: ("POST", "/v1/semaphores", {"name": 5, "capacity": 1}),
    ),
    "name-space": _acquire({" ": 1}),
    "name-trailing-space": _acquire({"{s} ": 1}),
    "name-newline": _acquire({"{s}\n": 1}),
    "name-newline-in-path": Case(
        lambda ctx: ctx.client.delete_semaphore(f"{ctx.s}\n", force=True),
        lambda ctx: ("DELETE", f"/v1/semaphores/{ctx.s}%0A?force=true", None),
    ),
    "name-unicode-lookalike": _acquire({"{ns}seм": 1}),
    "name-sql-quote": _acquire({"'; DROP TABLE permits_lease; --": 1}),
    "name-percent": _acquire({"%": 1}),
    "name-underscore": _acquire({"{ns}se_": 1}),
    "name-backslash": _acquire({"{s}\\": 1}),
    "count-zero": _acquire({"{s}": 0}),
    "count-negative": _acquire({"{s}": -1}),
    "count-over-capacity": _acquire({"{s}": 3}),
    "count-huge": _acquire({"{s}": 2**53}),
    "count-past-64-bits": _acquire({"{s}": 2**64}),
    "count-fraction": _acquire({"{s}": 1.5}),
    "count-string": _acquire({"{s}": "1"}),
    "count-bool": _acquire({"{s}": True}),
    "wants-empty": _acquire({}),
    "wants-twice": _acquire([("{s}", 1), ("{s}", 1)], [{"name": "{s}", "count": 1}, {"name": "{s}", "count": 1}]),
    "wants-too-many": _acquire({f"{{ns}}w{i}": 1 for i in range(65)}),
    "wants-number": _acquire(42),
    "ttl-zero": _acquire({"{s}": 1}, ttl=0),
    "ttl-negative": _acquire({"{s}": 1}, ttl=-5),
    "ttl-nan": _acquire({"{s}": 1}, ttl=math.nan),
    "ttl-inf": _acquire({"{s}": 1}, ttl=math.inf),
    "ttl-huge": _acquire({"{s}": 1}, ttl=31 * 24 * 3600),
    "ttl-string": _acquire({"{s}": 1}, ttl="10"),
    "extend-ttl-nan": Case(
        lambda ctx: ctx.client.extend(ctx.job, math.nan, owner=ctx.owner),
        lambda ctx: ("POST", "/v1/leases/extend", {"key": ctx.job, "ttl": math.nan}),
    ),
    "wait-negative": _acquire({"{s}": 1}, timeout=-1),
    "key-empty": _acquire({"{s}": 1}, key=""),
    "key-too-long": _acquire({"{s}": 1}, key="k" * 256),
    "key-nul": _acquire({"{s}": 1}, key="k\x00"),
    "key-reused": _acquire({"{s}": 2}, key="{job}"),
    "request-id-too-long": _acquire({"{s}": 1}, new_only=True, request_id="r" * 65),
    "request-id-not-text": _acquire({"{s}": 1}, new_only=True, request_id=7),
    "release-request-id-too-long": Case(
        lambda ctx: ctx.client.release(ctx.job, owner=ctx.owner, request_id="r" * 65),
        lambda ctx: ("POST", "/v1/leases/release", {"key": ctx.job, "request_id": "r" * 65}),
    ),
    "owner-too-long": _acquire({"{s}": 1}, owner="o" * 256),
    "owner-too-long-scoped": Case(
        None, lambda ctx: ("POST", "/v1/leases", {"wants": {ctx.s: 1}, "key": ctx.probe, "owner": "o" * 191})
    ),
    "capacity-zero": Case(
        lambda ctx: ctx.client.create_semaphore(f"{ctx.ns}new", 0),
        lambda ctx: ("POST", "/v1/semaphores", {"name": f"{ctx.ns}new", "capacity": 0}),
    ),
    "capacity-fraction": Case(
        lambda ctx: ctx.client.set_capacity(ctx.s, 2.5, reason="more"),
        lambda ctx: ("PATCH", f"/v1/semaphores/{ctx.s}", {"capacity": 2.5, "reason": "more"}),
    ),
    "who-nul": Case(
        lambda ctx: ctx.client.create_semaphore(f"{ctx.ns}new", 1, who="a\x00b"),
        lambda ctx: ("POST", "/v1/semaphores", {"name": f"{ctx.ns}new", "capacity": 1, "who": "a\x00b"}),
    ),
    "who-too-long": Case(
        lambda ctx: ctx.client.set_capacity(ctx.s, 3, reason="more", who="w" * 256),
        lambda ctx: ("PATCH", f"/v1/semaphores/{ctx.s}", {"capacity": 3, "reason": "more", "who": "w" * 256}),
    ),
    "reason-too-long": Case(
        lambda ctx: ctx.client.set_capacity(ctx.s, 3, reason="r" * 1001),
        lambda ctx: ("PATCH", f"/v1/semaphores/{ctx.s}", {"capacity": 3, "reason": "r" * 1001}),
    ),
    "body-too-large": Case(
        None, lambda ctx: ("POST", "/v1/leases", {"wants": {ctx.s: 1}, "key": ctx.probe, "pad": "x" * 70_000})
    ),
    "body-too-large-chunked": Case(
        None,
        lambda ctx: (
            "POST",
            "/v1/leases",
            Chunked((f'{{"wants": {{"{ctx.s}": 1}}, "pad": "'.encode(), *[b"x" * 8192] * 9)),
        ),
    ),
    "body-text-plain": Case(
        None,
        lambda ctx: ("POST", "/v1/leases", json.dumps({"wants": {ctx.s: 1}, "key": ctx.probe}).encode()),
        headers={"Content-Type": "text/plain"},
    ),
    "body-deeply-nested": _body('{"wants": ' + "[" * 5000 + "]" * 5000 + "}"),
    "body-not-json": _body("wants={s}"),
    "body-truncated-json": _body('{"wants": {"{s}": 1}'),
    "body-empty": _body(b""),
    "body-array": _body("[]"),
    "body-missing-field": _body('{"key": "k"}'),
    "body-extra-field": _body('{"wants": {"{s}": 1}, "colour": "red"}'),
    "body-wrong-type": _body('{"wants": {"{s}": 1}, "key": 7}'),
    "body-name-twice": _body('{"wants": {"{s}": 1, "{s}": 2}}'),
    "body-field-twice": _body('{"wants": {"{s}": 1}, "ttl": 5, "ttl": 500}'),
    "auth-missing": _as(None, _remote_acquire, _acquire_http),
    "auth-wrong": _as("not-a-token-of-this-service-0", _remote_acquire, _acquire_http),
    "auth-not-bearer": Case(None, _acquire_http, token=None, headers={"Authorization": f"Basic {CLIENT}"}),
    "auth-revoked": _as(REVOKED, _remote_acquire, _acquire_http),
    "auth-client-creates": _as(
        CLIENT,
        lambda remote, ctx: remote.create_semaphore(f"{ctx.ns}new", 1),
        lambda ctx: ("POST", "/v1/semaphores", {"name": f"{ctx.ns}new", "capacity": 1}),
    ),
    "auth-client-sets-capacity": _as(
        CLIENT,
        lambda remote, ctx: remote.set_capacity(ctx.s, 5, reason="mine"),
        lambda ctx: ("PATCH", f"/v1/semaphores/{ctx.s}", {"capacity": 5, "reason": "mine"}),
    ),
    "auth-client-deletes": _as(
        CLIENT,
        lambda remote, ctx: remote.delete_semaphore(ctx.s, force=True),
        lambda ctx: ("DELETE", f"/v1/semaphores/{ctx.s}?force=true", None),
    ),
    "auth-client-revokes": Case(
        None,
        lambda ctx: ("POST", "/v1/leases/revoke", {"key": ctx.job, "owner": ctx.owner, "reason": "mine"}),
        token=CLIENT,
    ),
    "auth-missing-bad-json": Case(
        None, lambda ctx: ("POST", "/v1/leases", ctx.fill('{"wants": {"{s}": 1}').encode()), token=None
    ),
    "auth-client-bad-fields": Case(
        None, lambda ctx: ("POST", "/v1/semaphores", {"name": "", "capacity": "many"}), token=CLIENT
    ),
    "revoke-reason-blank": Case(
        lambda ctx: ctx.client.revoke(ctx.job, owner=ctx.owner, reason=" "),
        lambda ctx: ("POST", "/v1/leases/revoke", {"key": ctx.job, "owner": ctx.owner, "reason": " "}),
    ),
    "capacity-reason-blank": Case(
        lambda ctx: ctx.client.set_capacity(ctx.s, 3, reason=" "),
        lambda ctx: ("PATCH", f"/v1/semaphores/{ctx.s}", {"capacity": 3, "reason": " "}),
    ),
    "exist-ok-not-a-flag": Case(
        lambda ctx: ctx.client.create_semaphore(ctx.s, 3, exist_ok="no"),
        lambda ctx: ("POST", "/v1/semaphores", {"name": ctx.s, "capacity": 3, "exist_ok": "no"}),
    ),
    "sweep-timeout-negative": Case(
        lambda ctx: ctx.client.sweep(timeout=-1), lambda ctx: ("POST", "/v1/sweep", {"timeout": -1})
    ),
    "reconcile-timeout-nan": Case(
        lambda ctx: ctx.client.reconcile(repair=True, timeout=math.nan),
        lambda ctx: ("POST", "/v1/reconcile", {"repair": True, "timeout": math.nan}),
    ),
    "path-not-utf8": Case(None, lambda ctx: ("GET", "/v1/holders/%ff", None)),
    "query-not-utf8": Case(None, lambda ctx: ("GET", "/v1/semaphores?prefix=%ff", None)),
    "query-twice": Case(None, lambda ctx: ("DELETE", f"/v1/semaphores/{ctx.s}?force=false&force=true", None)),
    "delete-body": Case(None, lambda ctx: ("DELETE", f"/v1/semaphores/{ctx.s}", {"force": True, "reason": "moved"})),
    "get-body": Case(None, lambda ctx: ("GET", f"/v1/holders/{ctx.s}", {"owner": "someone"})),
    "probe-body": Case(None, lambda ctx: ("GET", "/healthz", {"verbose": True})),
    "delete-body-no-token": Case(
        None, lambda ctx: ("DELETE", f"/v1/semaphores/{ctx.s}", {"force": True, "reason": "moved"}), token=None
    ),
    "delete-reason-too-long": Case(
        None, lambda ctx: ("DELETE", f"/v1/semaphores/{ctx.s}?force=true&reason={'r' * 1001}", None)
    ),
    "dashboard-no-token": Case(None, lambda ctx: ("GET", "/v1/overview", None), token=None),
    "events-cursor-garbage": Case(None, lambda ctx: ("GET", "/v1/events?since='; --", None)),
    "events-cursor-huge": Case(None, lambda ctx: ("GET", "/v1/events?since=g9999999999999999999.e1.c1.a1", None)),
}


# ---------------------------------------------------------------------------------------------- running


@pytest.fixture(scope="module", params=["sqlite", "mysql", "postgresql"])
def deployment(
    request: pytest.FixtureRequest, servers: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Service]]:
    url = module_db_url(str(request.param), servers, tmp_path_factory, "bad-input")
    with running(url, tokens=TOKENS, env={"PERMITS_MAINTENANCE__ENABLED": "false"}) as service:
        yield url, service


def _state(ctx: Ctx) -> tuple[Any, ...]:
    """Everything a refused request might have written."""
    sems = [(x.name, x.capacity, x.used, x.last_token, x.fair) for x in ctx.client.list_semaphores(ctx.ns)]
    holders = [(h.owner, h.key, h.count, h.token, h.expires_at) for h in ctx.client.holders(ctx.s)]
    history = [(c.old_capacity, c.new_capacity, c.reason) for c in ctx.client.capacity_history(ctx.s)]
    logged = httpx.get(
        f"{ctx.service.url}/v1/admin-log", params={"name": ctx.s}, headers={"Authorization": f"Bearer {ADMIN}"}
    ).json()["entries"]
    return sems, holders, history, logged


def _no_probe_lease(ctx: Ctx, http: httpx.Client) -> None:
    with pytest.raises(permits.LeaseNotFound):
        ctx.client.get_lease(ctx.probe, owner=ctx.owner)
    for identity in TOKENS:
        with pytest.raises(permits.LeaseNotFound):
            ctx.client.get_lease(ctx.probe, owner=str(identity["name"]))
    assert http.get(f"/v1/leases/{ctx.probe}").status_code == 404


def test_every_row_has_a_case_and_every_case_a_row() -> None:
    assert len(ROWS) >= 50
    rows = [row.case for row in ROWS]
    assert len(set(rows)) == len(rows), "a case appears twice in docs/bad-input.md"
    assert sorted(set(rows) - set(CASES)) == [], "rows of docs/bad-input.md with no test here"
    assert sorted(set(CASES) - set(rows)) == [], "cases here with no row in docs/bad-input.md"
    for row in ROWS:
        assert row.changes == "nothing"
        assert (row.library is None) == (CASES[row.case].library is None), f"{row.case}: library column"


@pytest.mark.parametrize("row", ROWS, ids=[row.case for row in ROWS])
def test_row(row: Row, deployment: tuple[str, Service], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PERMITS_TOKEN", raising=False)
    case = CASES.get(row.case)
    assert case is not None, f"docs/bad-input.md has a row {row.case!r} that no test runs"
    db_url, service = deployment
    ns = f"b{uuid.uuid4().hex[:8]}-"
    with (
        permits.connect(db_url, owner=f"{ns}owner") as client,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as admin,
    ):
        ctx = Ctx(client, service, ns, f"{ns}sem", f"{ns}job-1", f"{ns}probe", f"{ns}owner")
        client.create_semaphore(ctx.s, 2)
        client.acquire(ctx.s, key=ctx.job, owner=ctx.owner)
        assert admin.post("/v1/leases", json={"wants": {ctx.s: 1}, "key": ctx.job}).status_code == 201
        before = _state(ctx)

        if row.library is not None:
            assert case.library is not None
            code, named = row.library
            with pytest.raises(PermitsError) as raised:
                case.library(ctx)
            assert raised.value.code == code, raised.value
            assert isinstance(raised.value, error_class(code))
            if named is not None:
                assert raised.value.details.get("field") == named, raised.value.details
            assert _state(ctx) == before
            _no_probe_lease(ctx, admin)

        method, path, body = case.http(ctx)
        headers = dict(case.headers)
        if case.token is not None:
            headers["Authorization"] = f"Bearer {case.token}"
        content: Any
        if isinstance(body, Chunked):
            headers.setdefault("Content-Type", "application/json")
            content = iter(body.parts)
        elif isinstance(body, bytes):
            headers.setdefault("Content-Type", "application/json")
            content = body
        else:
            content = b"" if body is None else json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        with httpx.Client(base_url=service.url, timeout=30) as http:
            response = http.request(method, path, content=content, headers=headers)
        answer = response.json()
        status, code, named = row.http
        assert (response.status_code, answer["error"]["code"]) == (status, code), answer
        declared = _declared_statuses(service, method, path)
        assert declared is None or str(status) in declared, f"{method} {path}: {status} is not in {declared}"
        if named is not None:
            assert answer["error"]["details"].get("field") == named, answer
        assert set(answer["error"]) == {"code", "message", "details"}
        assert _state(ctx) == before
        _no_probe_lease(ctx, admin)


_DOCUMENTS: dict[str, dict[str, Any]] = {}


def _declared_statuses(service: Service, method: str, path: str) -> set[str] | None:
    """The statuses that the service's OpenAPI document lists for the operation that serves ``method`` on
    ``path`` (None: no operation does, a request that routing refuses). A path without parameters wins
    over one whose parameter would match it too (``/v1/leases/release`` over ``/v1/leases/{key}``)."""
    if service.url not in _DOCUMENTS:
        _DOCUMENTS[service.url] = httpx.get(f"{service.url}/openapi.json", timeout=30).json()
    path = path.partition("?")[0]
    templates = sorted(_DOCUMENTS[service.url]["paths"].items(), key=lambda item: "{" in item[0])
    for template, operations in templates:
        pattern = "".join(
            ".*" if part.startswith("{") else re.escape(part) for part in re.split(r"({[^}]+})", template)
        )
        if re.fullmatch(pattern, path, re.DOTALL) and method.lower() in operations:
            return set(operations[method.lower()]["responses"])
    return None


@pytest.mark.parametrize("name", ["'; DROP TABLE permits_lease; --", "%", "_", "a\\b", "100%_done", " ", "lóck"])
def test_names_that_look_like_sql_are_names(client: Any, ns: str, name: str) -> None:
    """What the notes under the table say: such a name is stored and found as written, and no prefix is a
    pattern."""
    full = ns + name
    client.create_semaphore(full, 1)
    assert client.get_semaphore(full).name == full
    assert [s.name for s in client.list_semaphores(ns)] == [full]
    assert client.list_semaphores(ns + "%") == [] or name.startswith("%")
    assert client.list_semaphores(ns + "_") == [] or name.startswith("_")
    lease = client.try_acquire(full)
    assert [h.key for h in client.holders(full)] == [lease.key]


@pytest.mark.parametrize(
    "text",
    ["'; DROP TABLE permits_lease; --", "%", "_", "a\\b", "' OR '1'='1", "lóck", "\U0001f512" * 255, "a\u0301\u200f"],
    ids=["sql-quote", "percent", "underscore", "backslash", "or-true", "accented", "emoji-x255", "combining-rtl"],
)
def test_keys_and_owners_that_look_like_sql_are_keys_and_owners(client: Any, ns: str, text: str) -> None:
    """The notes under the table, for keys and owners: stored and found exactly as written, 4-byte
    characters up to the full 255 included, and no key is a pattern that finds another."""
    name, owner = f"{ns}s", (ns + text)[:255]  # the owner keeps each test's keys apart
    client.create_semaphore(name, 2)
    lease = client.acquire(name, key=text, owner=owner, ttl=30)
    assert (lease.key, lease.owner) == (text, owner)
    assert client.get_lease(text, owner=owner).tokens == lease.tokens
    assert [(h.owner, h.key) for h in client.holders(name)] == [(owner, text)]
    for pattern in {"%", "_", "%%"} - {text}:
        with pytest.raises(permits.LeaseNotFound):
            client.get_lease(pattern, owner=owner)
    assert client.acquire(name, key=text, owner=owner, ttl=30).tokens == lease.tokens  # a retry: the same lease
    assert client.release(text, owner=owner) is permits.ReleaseOutcome.RELEASED


@pytest.mark.parametrize(
    "row",
    [row for row in ROWS if row.library is not None],
    ids=[row.case for row in ROWS if row.library is not None],
)
def test_row_through_the_remote_client(
    row: Row, deployment: tuple[str, Service], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library's answer holds when the library talks to the service instead of the database (an admin
    token): the same code, and nothing changed. The field is the library's, or the one the service names
    (the notes under the table say why they may differ). Most rows are refused by the client's own checks
    before any request is sent; the rest (a missing semaphore, a count over the capacity, a reused key)
    are the service's answers, turned back into the library's exceptions."""
    monkeypatch.delenv("PERMITS_TOKEN", raising=False)
    case = CASES[row.case]
    assert case.library is not None and row.library is not None
    db_url, service = deployment
    ns = f"r{uuid.uuid4().hex[:8]}-"
    with (
        permits.connect(db_url, owner=f"{ns}owner") as client,
        permits.connect(service.url, token=ADMIN, owner=f"{ns}owner") as remote,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as admin,
    ):
        ctx = Ctx(client, service, ns, f"{ns}sem", f"{ns}job-1", f"{ns}probe", f"{ns}owner")
        client.create_semaphore(ctx.s, 2)
        client.acquire(ctx.s, key=ctx.job, owner=ctx.owner)
        remote.acquire(ctx.s, key=ctx.job, owner=ctx.owner)  # stored as the admin identity's ctx.owner
        before = _state(ctx)
        code, named = row.library
        with pytest.raises(PermitsError) as raised:
            case.library(dataclasses.replace(ctx, client=remote))
        assert raised.value.code == code, raised.value
        assert isinstance(raised.value, error_class(code))
        if named is not None:
            assert raised.value.details.get("field") in (named, row.http[2]), raised.value.details
        assert _state(ctx) == before
        _no_probe_lease(ctx, admin)
        with pytest.raises(permits.LeaseNotFound):  # where the service would have stored it
            client.get_lease(ctx.probe, owner=f"{TOKENS[0]['name']}/{ctx.owner}")
