"""Request and response bodies of the /v1 API, for validation and the OpenAPI document.

Requests are strict: unknown fields, strings for numbers and booleans for counts are refused with 422.
The range checks (name length, NUL characters, ttl bounds, ...) are the library's own, so a request
through the service is refused exactly as the same call to the library would be. The document states
each of those checks too (``documented``), so that a request it calls valid is never refused: a client
generated from it, or a fuzzer, can trust it. Responses are built by ``permits._wire``; the models below
describe them (tests check that the two agree).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path, Query
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
)

from permits import _validate

#: JSON Schema patterns for what the library refuses in text (its own check gives the message).
NO_NUL = "^[^\\u0000]*$"
#: White space as the library's ``str.strip()`` sees it, spelt out: JSON Schema's ``\\s`` (ECMA) differs.
_SPACE = "\\t\\n\\u000b\\f\\r\\u001c-\\u001f \\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"
#: A reason an action cannot go without: some character other than white space, and no NUL.
SOME_TEXT = f"^[^\\u0000]*[^{_SPACE}\\u0000][^\\u0000]*$"
#: An event feed's cursor (``server/events.py``).
CURSOR = "^g[0-9]{1,19}\\.e[0-9]{1,19}\\.c[0-9]{1,19}\\.a[0-9]{1,19}$"


def documented(**schema: Any) -> Any:
    """A constraint stated in the OpenAPI document and checked by the library, not by pydantic, so that a
    request breaking it gets the library's message, as the same call to the library would."""
    return Field(json_schema_extra=schema)


def _whole_number(value: object) -> object:
    # JSON has one kind of number: 3.0 is the integer 3 to JSON Schema, and to a client in a language
    # without integers. Booleans and strings still fail the strict check after this.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# A number of seconds; a whole number is taken too (strict: no strings or booleans).
Seconds = Annotated[float, Field(strict=True, ge=0, description="seconds")]
Name = Annotated[
    StrictStr,
    Field(min_length=1, max_length=_validate.MAX_NAME_LENGTH, description="a semaphore name"),
    documented(pattern=NO_NUL),
]
Key = Annotated[StrictStr, Field(min_length=1, max_length=_validate.MAX_KEY_LENGTH), documented(pattern=NO_NUL)]
Owner = Annotated[StrictStr, Field(min_length=1, max_length=_validate.MAX_OWNER_LENGTH), documented(pattern=NO_NUL)]
RequestId = Annotated[
    StrictStr, Field(min_length=1, max_length=_validate.MAX_REQUEST_ID_LENGTH), documented(pattern=NO_NUL)
]
Count = Annotated[StrictInt, Field(ge=1, le=_validate.MAX_CAPACITY), BeforeValidator(_whole_number)]
Reason = Annotated[StrictStr, Field(max_length=_validate.MAX_REASON_LENGTH), documented(pattern=NO_NUL)]
Ttl = Annotated[
    float, Field(strict=True), documented(minimum=_validate.MIN_TTL_SECONDS, maximum=_validate.MAX_TTL_SECONDS)
]
RequiredReason = Annotated[
    StrictStr, Field(max_length=_validate.MAX_REASON_LENGTH), documented(pattern=SOME_TEXT, minLength=1)
]
BatchSize = Annotated[StrictInt, Field(ge=1, le=100_000), BeforeValidator(_whole_number)]
#: A fencing token: a decimal string, exact up to 2**63-1 in every language.
Token = Annotated[StrictStr, Field(pattern=r"^[0-9]{1,19}$", examples=["17"])]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WantIn(_Strict):
    name: Name
    count: Count = 1


def _wants_form(value: Any) -> str | None:
    return "list" if isinstance(value, list) else "map" if isinstance(value, dict) else None


#: Fields whose value takes one of several forms, told apart by the value's JSON type: a mistake inside one
#: form is reported in that form's terms alone, and the form's tag, which pydantic puts in an error's
#: location after the field's name, is left out of the field named in the answer (server/errors.py).
TAGGED_FIELDS = frozenset({"wants"})


class AcquireIn(_Strict):
    wants: Annotated[
        # uniqueItems says part of what the library checks: no semaphore may be named twice, with any count.
        Annotated[list[WantIn], documented(minItems=1, maxItems=_validate.MAX_WANTS, uniqueItems=True), Tag("list")]
        | Annotated[
            dict[Annotated[StrictStr, Field(min_length=1, max_length=_validate.MAX_NAME_LENGTH)], Count],
            documented(
                minProperties=1,
                maxProperties=_validate.MAX_WANTS,
                propertyNames={"minLength": 1, "maxLength": _validate.MAX_NAME_LENGTH, "pattern": NO_NUL},
            ),
            Tag("map"),
        ],
        Discriminator(
            _wants_form,
            custom_error_type="wants_form",
            custom_error_message='Input should be a list ([{"name": "db", "count": 1}]) or a map ({"db": 1})',
        ),
    ] = Field(description='the permits to take, all or nothing: [{"name": "db", "count": 1}] or {"db": 1}')
    key: Key | None = Field(default=None, description="idempotency key: retrying with it never grants twice")
    owner: Owner | None = Field(default=None, description="scopes keys within your identity (default: the identity)")
    ttl: Ttl | None = Field(default=None, description="lease TTL in seconds (default: the service's)")
    wait: Seconds = Field(default=0, description="how long to wait for room before answering 409 acquire_timeout")
    keep_place: StrictBool = Field(
        default=False,
        description=(
            "on a fair semaphore, keep this request's place in the queue after a 409, for a retry with the same"
            " key within 5 s (then give it up with POST /v1/leases/give-up); by default a request that times"
            " out gives its place up"
        ),
    )

    new_only: StrictBool = Field(
        default=False,
        description=(
            "grant a new lease only: a key that names a lease already, held or ended, is refused (409 key_in_use)"
            " instead of answered with that lease, so two callers that chose the same key (and owner) cannot both"
            " hold it. Send a request_id with it, so that a retry of a request whose reply was lost gets its own"
            " lease back; without one, a request that may have been granted is not to be sent again"
        ),
    )
    request_id: RequestId | None = Field(
        default=None,
        description=(
            "with new_only: an id of your making (a uuid) for this request, the same in each of its retries; the"
            " lease records it, and a retry that finds it is answered with that lease (ignored without new_only)"
        ),
    )

    def want_pairs(self) -> list[tuple[str, int]]:
        if isinstance(self.wants, dict):
            return list(self.wants.items())
        return [(w.name, w.count) for w in self.wants]


class LeaseRefIn(_Strict):
    key: Key
    owner: Owner | None = None


class ReleaseIn(LeaseRefIn):
    request_id: RequestId | None = Field(
        default=None,
        description=(
            "release only the lease that this request got (the request_id an acquire with new_only sent): a lease"
            " under the key that records another request's id, or none, is left alone and not_found is answered"
            " (for a client that gave up on an acquire whose outcome it never learned)"
        ),
    )


class ExtendIn(LeaseRefIn):
    ttl: Ttl | None = Field(
        default=None,
        description=(
            "the time from now, in seconds, the lease is to last (default: the lease's own TTL, the one it was"
            " granted with)"
        ),
    )


class RevokeIn(_Strict):
    key: Key
    owner: Owner = Field(description="the lease's owner as stored (see the holders list)")
    reason: RequiredReason


class CreateSemaphoreIn(_Strict):
    name: Name
    capacity: Count
    exist_ok: StrictBool = False
    fair: StrictBool = Field(default=False, description="serve waiting acquires in arrival order")
    who: Owner | None = Field(default=None, description="recorded in the capacity history (default: your identity)")
    reason: Reason | None = Field(default=None, description="why, for the admin log")


class SetCapacityIn(_Strict):
    capacity: Count
    reason: RequiredReason
    who: Owner | None = None


class SweepIn(_Strict):
    batch_size: BatchSize = 500
    max_batches: BatchSize | None = None
    timeout: Seconds | None = Field(
        default=None, description="start no batch after this many seconds; the answer then says complete: false"
    )


class ReconcileIn(_Strict):
    repair: StrictBool = False
    timeout: Seconds | None = Field(
        default=None, description="start no repair after this many seconds; the drift left is answered unrepaired"
    )


# ------------------------------------------------------------------------------------------- responses


class LeaseOut(BaseModel):
    key: str
    owner: str
    counts: dict[str, int]
    tokens: dict[str, Token]
    acquired_at: str
    expires_at: str
    expires_in: float
    held: bool
    end_reason: str | None
    ended_at: str | None
    end_note: str | None
    ttl: float | None = Field(
        description="the TTL it was granted with, in seconds, which an extend without a ttl renews it by (null: a"
        " lease granted before the database kept TTLs)"
    )


class SemaphoreOut(BaseModel):
    name: str
    capacity: int
    used: int
    available: int
    last_token: Token
    fair: bool
    created_at: str
    updated_at: str


class SemaphoreListOut(BaseModel):
    semaphores: list[SemaphoreOut]


class HolderOut(BaseModel):
    key: str | None = Field(description="null for another client's lease, unless you are an admin")
    owner: str
    count: int
    token: Token
    acquired_at: str
    expires_at: str
    expires_in: float


class HoldersOut(BaseModel):
    name: str
    holders: list[HolderOut]


class WaiterOut(BaseModel):
    key: str | None = Field(description="null for another client's request, unless you are an admin")
    owner: str
    count: int
    ticket: int
    waiting_since: str
    place_expires_in: float


class WaitersOut(BaseModel):
    name: str
    waiters: list[WaiterOut]


class CapacityChangeOut(BaseModel):
    name: str
    old_capacity: int | None
    new_capacity: int
    changed_by: str
    reason: str
    changed_at: str


class CapacityHistoryOut(BaseModel):
    changes: list[CapacityChangeOut]


class GiveUpOut(BaseModel):
    places: int = Field(description="how many places in fair queues the request held, now given up")


class ReleaseOut(BaseModel):
    outcome: str = Field(description="released, already_released, lost or not_found")


class DeletedOut(BaseModel):
    deleted: str
    revoked: int


class SweepOut(BaseModel):
    leases: int
    batches: int
    keys: list[dict[str, str]]
    complete: bool = Field(description="false: max_batches or the timeout ended the sweep, and more may be expired")


class DriftOut(BaseModel):
    name: str
    field: Literal["used", "last_token", "orphaned_permits", "last_ticket"]
    recorded: int
    actual: int
    repaired: bool


class ReconcileOut(BaseModel):
    drift: list[DriftOut]


class LimitsOut(BaseModel):
    max_wait: float
    max_ttl: float
    max_wants: int
    default_ttl: float = Field(description="the TTL of a lease acquired without one: 60 s, or max_ttl if lower")
    answer_grace: float = Field(
        description="how long past a request's wait this service may take to answer while healthy (its pre-lock"
        " wait, then its store's least wait for a database's answer): a client waits at least this long"
    )


class WhoAmIOut(BaseModel):
    identity: str
    admin: bool
    version: str
    limits: LimitsOut
    features: list[str] = Field(description="what this service supports beyond the first API: keep_place")


class ErrorDetail(BaseModel):
    code: str = Field(description="stable error code; see docs/service.md")
    message: str
    details: dict[str, str | int | float | bool | None]


class ErrorOut(BaseModel):
    error: ErrorDetail


#: Seconds a client should wait before retrying a 503 or a 429 (errors.py sends it on every one).
RETRY_AFTER_SECONDS = 1


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses of these error statuses: an ``ErrorOut`` body, and on a 429 or a 503 the
    ``Retry-After`` header that every one of them carries."""
    retry_after = {
        "Retry-After": {
            "description": "seconds to wait before sending the request again (then with the same key)",
            "required": True,
            "schema": {"type": "integer", "minimum": 0},
        }
    }
    return {
        status: {"model": ErrorOut, **({"headers": retry_after} if status in (429, 503) else {})} for status in statuses
    }


# ------------------------------------------------------------------------------ path and query parameters
#
# Checked by the library (or the event feed's parser) like the bodies' fields; stated here for the
# document only.


def _text_parameter(where: Any, what: str, max_length: int) -> Any:
    return where(description=what, json_schema_extra={"minLength": 1, "maxLength": max_length, "pattern": NO_NUL})


NameInPath = Annotated[str, _text_parameter(Path, "a semaphore name", _validate.MAX_NAME_LENGTH)]
KeyInPath = Annotated[str, _text_parameter(Path, "a lease key", _validate.MAX_KEY_LENGTH)]
NameInQuery = Annotated[str | None, _text_parameter(Query, "a semaphore name", _validate.MAX_NAME_LENGTH)]
OwnerInQuery = Annotated[str | None, _text_parameter(Query, "an owner", _validate.MAX_OWNER_LENGTH)]
CursorInQuery = Annotated[
    str | None, Query(description="a cursor an earlier answer gave", json_schema_extra={"pattern": CURSOR})
]


def state_limits(
    document: dict[str, Any], max_wants: int, max_ttl: float, max_wait: float, max_owner: int | None
) -> None:
    """Write one instance's limits into its OpenAPI document (in place), where they are tighter than the
    library's: a request the document calls valid is then never refused for a limit it did not state.
    ``max_owner``: the longest owner a client may name, on a service with tokens (None: the library's)."""
    bodies = document["components"]["schemas"]
    if max_owner is not None:
        # Every owner or who a client names is stored under its identity; a revoke's owner is as stored.
        named = [("AcquireIn", "owner"), ("LeaseRefIn", "owner"), ("ReleaseIn", "owner"), ("ExtendIn", "owner")]
        for body, field in [*named, ("CreateSemaphoreIn", "who"), ("SetCapacityIn", "who")]:
            for branch in bodies[body]["properties"][field]["anyOf"]:
                if branch.get("type") == "string":
                    branch["maxLength"] = max_owner
        for operation in document["paths"].values():
            for parameter in (p for method in operation.values() for p in method.get("parameters", [])):
                if parameter["name"] == "owner" and parameter["in"] == "query":
                    parameter["schema"]["maxLength"] = max_owner
    acquire = bodies["AcquireIn"]["properties"]
    for branch in acquire["wants"]["oneOf"]:
        branch["maxItems" if branch["type"] == "array" else "maxProperties"] = max_wants
    for ttl in (acquire["ttl"], bodies["ExtendIn"]["properties"]["ttl"]):
        for branch in ttl["anyOf"]:
            if branch.get("type") == "number":
                branch["maximum"] = min(branch["maximum"], max_ttl)
    acquire["wait"]["maximum"] = max_wait


def state_security(document: dict[str, Any]) -> None:
    """On a service with tokens, say in its OpenAPI document (in place) that every call but the health checks
    needs a bearer token: ``/docs`` then offers to send one, and a generated client to take one."""
    document.setdefault("components", {})["securitySchemes"] = {
        "token": {
            "type": "http",
            "scheme": "bearer",
            "description": "a token from the service's tokens setting (docs/service.md: authentication)",
        }
    }
    for path, operations in document["paths"].items():
        if path.startswith("/v1/") or path == "/metrics":
            for operation in operations.values():
                operation["security"] = [{"token": []}]
