"""Request and response bodies of the /v1 API, for validation and the OpenAPI document.

Requests are strict: unknown fields, strings for numbers and booleans for counts are refused with 422.
The range checks (name length, NUL characters, ttl bounds, ...) are the library's own, so a request
through the service is refused exactly as the same call to the library would be. Responses are built
by ``permits._wire``; the models below describe them (tests check that the two agree).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from permits import _validate

Seconds = Annotated[StrictFloat | StrictInt, Field(description="seconds", ge=0)]
Name = Annotated[StrictStr, Field(min_length=1, max_length=_validate.MAX_NAME_LENGTH, description="a semaphore name")]
Key = Annotated[StrictStr, Field(min_length=1, max_length=_validate.MAX_KEY_LENGTH)]
Owner = Annotated[StrictStr, Field(min_length=1, max_length=_validate.MAX_OWNER_LENGTH)]
Count = Annotated[StrictInt, Field(ge=1, le=_validate.MAX_CAPACITY)]
Reason = Annotated[StrictStr, Field(max_length=_validate.MAX_REASON_LENGTH)]
#: A fencing token: a decimal string, exact up to 2**63-1 in every language.
Token = Annotated[StrictStr, Field(pattern=r"^[0-9]{1,19}$", examples=["17"])]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WantIn(_Strict):
    name: Name
    count: Count = 1


class AcquireIn(_Strict):
    wants: list[WantIn] | dict[Name, Count] = Field(
        description='the permits to take, all or nothing: [{"name": "db", "count": 1}] or {"db": 1}'
    )
    key: Key | None = Field(default=None, description="idempotency key: retrying with it never grants twice")
    owner: Owner | None = Field(default=None, description="scopes keys within your identity (default: the identity)")
    ttl: Seconds | None = Field(default=None, description="lease TTL (default: the service's)")
    wait: Seconds = Field(default=0, description="how long to wait for room before answering 409 acquire_timeout")

    def want_pairs(self) -> list[tuple[str, int]]:
        if isinstance(self.wants, dict):
            return list(self.wants.items())
        return [(w.name, w.count) for w in self.wants]


class LeaseRefIn(_Strict):
    key: Key
    owner: Owner | None = None


class ExtendIn(LeaseRefIn):
    ttl: Seconds | None = None


class RevokeIn(_Strict):
    key: Key
    owner: Owner = Field(description="the lease's owner as stored (see the holders list)")
    reason: Reason


class CreateSemaphoreIn(_Strict):
    name: Name
    capacity: Count
    exist_ok: StrictBool = False
    fair: StrictBool = Field(default=False, description="serve waiting acquires in arrival order")
    who: Owner | None = Field(default=None, description="recorded in the capacity history (default: your identity)")
    reason: Reason | None = Field(default=None, description="why, for the admin log")


class SetCapacityIn(_Strict):
    capacity: Count
    reason: Reason
    who: Owner | None = None


class SweepIn(_Strict):
    batch_size: Annotated[StrictInt, Field(ge=1, le=100_000)] = 500
    max_batches: Annotated[StrictInt, Field(ge=1, le=100_000)] | None = None


class ReconcileIn(_Strict):
    repair: StrictBool = False


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


class ReleaseOut(BaseModel):
    outcome: str = Field(description="released, already_released, lost or not_found")


class DeletedOut(BaseModel):
    deleted: str
    revoked: int


class SweepOut(BaseModel):
    leases: int
    batches: int
    keys: list[dict[str, str]]


class DriftOut(BaseModel):
    name: str
    field: Literal["used", "last_token", "orphaned_permits"]
    recorded: int
    actual: int
    repaired: bool


class ReconcileOut(BaseModel):
    drift: list[DriftOut]


class LimitsOut(BaseModel):
    max_wait: float
    max_ttl: float
    max_wants: int


class WhoAmIOut(BaseModel):
    identity: str
    admin: bool
    version: str
    limits: LimitsOut


class ErrorDetail(BaseModel):
    code: str = Field(description="stable error code; see docs/service.md")
    message: str
    details: dict[str, str | int | float | bool | None]


class ErrorOut(BaseModel):
    error: ErrorDetail
