"""The values the API hands out: plain, frozen, and free of any connection."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


def ms_to_datetime(ms: int) -> datetime:
    """A database timestamp (milliseconds since the epoch, UTC) as an aware datetime."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


class EndReason(enum.StrEnum):
    """Why a lease ended. Every ended lease records one."""

    RELEASED = "released"  # its holder released it
    EXPIRED = "expired"  # its TTL passed; an acquire that needed the room, or a late release, ended it
    SWEPT = "swept"  # its TTL passed; the batched sweep ended it
    REVOKED = "revoked"  # an administrator ended it (forced delete of its semaphore, force-release)
    OWNER_DEAD = "owner_dead"  # the service's liveness check found its owner dead
    STALE = "stale"  # it was held longer than the service's maximum lease age


class ReleaseOutcome(enum.StrEnum):
    """What ``release`` found."""

    RELEASED = "released"  # the lease was held, and now its permits are back
    ALREADY_RELEASED = "already_released"  # its holder had released it before; nothing changed
    LOST = "lost"  # it had ended (or expired) before this call: the holder did not hold it to the end
    NOT_FOUND = "not_found"  # no lease was ever granted under this key for this owner


@dataclass(frozen=True, slots=True)
class Want:
    """``count`` permits of the semaphore ``name``: one part of an all-or-nothing request."""

    name: str
    count: int = 1


@dataclass(frozen=True, slots=True)
class Lease:
    """A grant: permits of one or more semaphores, held until released or expired.

    Times come from the database's clock. ``expires_in`` is the time left when the database answered,
    in seconds; it is the only figure a client should do arithmetic with, since its own clock may differ
    from the database's.
    """

    key: str
    owner: str
    #: permits held, per semaphore name
    counts: dict[str, int]
    #: fencing token per semaphore name; strictly increasing per semaphore, never reused
    tokens: dict[str, int]
    acquired_at: datetime
    expires_at: datetime
    expires_in: float
    #: ``None`` while held, else why it ended
    end_reason: EndReason | None = None
    ended_at: datetime | None = None
    #: how it ended, in words: an administrator's reason for a revoke, or what maintenance found
    end_note: str | None = None
    #: the TTL it was granted with, in seconds, which an extend without a TTL renews it by; ``None`` for a
    #: lease granted before the database kept TTLs (schema revision 0008)
    ttl: float | None = None

    def __hash__(self) -> int:
        # By what names the lease, so that leases go in sets and dict keys: equal leases have the same
        # owner and key, and the fields' dicts cannot be hashed.
        return hash((self.owner, self.key))

    @property
    def held(self) -> bool:
        return self.end_reason is None and self.expires_in > 0

    @property
    def token(self) -> int:
        """The fencing token when the lease covers exactly one semaphore (the common case)."""
        if len(self.tokens) != 1:
            raise ValueError("this lease covers several semaphores: use .tokens[name]")
        return next(iter(self.tokens.values()))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view. Tokens stay integers: they fit in a signed 64-bit column."""
        return {
            "key": self.key,
            "owner": self.owner,
            "counts": dict(self.counts),
            "tokens": dict(self.tokens),
            "acquired_at": self.acquired_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "expires_in": round(self.expires_in, 3),
            "end_reason": None if self.end_reason is None else str(self.end_reason),
            "ended_at": None if self.ended_at is None else self.ended_at.isoformat(),
            "end_note": self.end_note,
            "ttl": self.ttl,
        }


@dataclass(frozen=True, slots=True)
class Semaphore:
    """A named counter of permits, as the database last saw it."""

    name: str
    capacity: int
    #: permits held now, including those of leases that expired but were not reclaimed yet
    used: int
    #: the highest fencing token handed out so far (0 before the first grant)
    last_token: int
    created_at: datetime
    updated_at: datetime
    #: serves its waiters in arrival order (see ``create_semaphore(fair=True)``)
    fair: bool = False

    @property
    def available(self) -> int:
        return max(0, self.capacity - self.used)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "capacity": self.capacity,
            "used": self.used,
            "available": self.available,
            "last_token": self.last_token,
            "fair": self.fair,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class Holder:
    """One lease's share of one semaphore."""

    key: str
    owner: str
    count: int
    token: int
    acquired_at: datetime
    expires_at: datetime
    expires_in: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "owner": self.owner,
            "count": self.count,
            "token": self.token,
            "acquired_at": self.acquired_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "expires_in": round(self.expires_in, 3),
        }


@dataclass(frozen=True, slots=True)
class Waiter:
    """A request waiting for room on a fair semaphore, in its place in the queue."""

    key: str
    owner: str
    count: int
    #: its place: the semaphore serves the lowest ticket first
    ticket: int
    waiting_since: datetime
    #: seconds until the place is given up unless the waiter asks again (it does, while it waits)
    place_expires_in: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "owner": self.owner,
            "count": self.count,
            "ticket": self.ticket,
            "waiting_since": self.waiting_since.isoformat(),
            "place_expires_in": round(self.place_expires_in, 3),
        }


#: The capacity of a read-write lock (``create_rwlock``): how many readers may hold it at once. A writer
#: takes all of it (``exclusive``); a reader takes one permit (``shared``).
RWLOCK_READERS = 1_000_000


def shared(name: str) -> Want:
    """A read (shared) hold on the read-write lock ``name``: one of its permits."""
    return Want(name, 1)


def exclusive(name: str) -> Want:
    """A write (exclusive) hold on the read-write lock ``name``: all of its permits."""
    return Want(name, RWLOCK_READERS)


@dataclass(frozen=True, slots=True)
class CapacityChange:
    """An audit record: who changed a semaphore's capacity, when, why, from what to what."""

    name: str
    old_capacity: int | None  # None when the record is the semaphore's creation
    new_capacity: int
    changed_by: str
    reason: str
    changed_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "old_capacity": self.old_capacity,
            "new_capacity": self.new_capacity,
            "changed_by": self.changed_by,
            "reason": self.reason,
            "changed_at": self.changed_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class Drift:
    """A semaphore row that disagrees with its permit rows.

    ``field`` says what disagrees: ``"used"``, the count of permits in use, against the sum over the
    permit rows of held leases; ``"last_token"``, the last fencing token handed out, which must be at
    least the highest token of any permit row (else the next grant would meet a token already given, and
    the unique key would refuse every grant of that semaphore); ``"orphaned_permits"``, permit rows
    whose lease is gone (``recorded`` of them, where there should be none); or ``"last_ticket"``, the
    last ticket of a fair queue (on PostgreSQL, of the sequence every semaphore shares), which must be at
    least the highest ticket of any place in the queue."""

    name: str
    recorded: int  # the value on the semaphore row (PostgreSQL's ticket counter: its sequence)
    actual: int  # what the permit rows, or the queue's places, say it should be
    repaired: bool = False
    field: str = "used"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "field": self.field,
            "recorded": self.recorded,
            "actual": self.actual,
            "repaired": self.repaired,
        }


@dataclass(frozen=True, slots=True)
class SweepResult:
    """What one sweep ended."""

    leases: int = 0
    batches: int = 0
    keys: list[tuple[str, str]] = field(default_factory=list)  # (owner, key) of each lease it ended
    #: Whether the sweep ran until a batch found fewer expired leases than it holds, none being left then;
    #: false where ``max_batches`` or the caller's ``timeout`` ended it first: more may be left.
    complete: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "leases": self.leases,
            "batches": self.batches,
            "keys": [{"owner": owner, "key": key} for owner, key in self.keys],
            "complete": self.complete,
        }
