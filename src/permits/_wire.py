"""The JSON form of permits' values, as the HTTP service sends them and the remote client reads them.

Fencing tokens travel as decimal strings: they go up to 2**63-1, and a JSON number above 2**53 loses
digits in JavaScript and in any parser that reads numbers as doubles. A string is exact in every language;
parse it as a signed 64-bit integer. Counts and capacities stay numbers (they are at most 2**53-1).
Times are ISO 8601 in UTC, from the database's clock; ``expires_in`` is seconds left when the database
answered, the only figure a client should do arithmetic with.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from permits._exceptions import ServiceError
from permits._models import (
    CapacityChange,
    Drift,
    EndReason,
    Holder,
    Lease,
    Semaphore,
    SweepResult,
    Waiter,
)


def lease_out(lease: Lease) -> dict[str, Any]:
    return {
        "key": lease.key,
        "owner": lease.owner,
        "counts": dict(lease.counts),
        "tokens": {name: str(token) for name, token in lease.tokens.items()},
        "acquired_at": lease.acquired_at.isoformat(),
        "expires_at": lease.expires_at.isoformat(),
        "expires_in": round(lease.expires_in, 3),
        "held": lease.held,
        "end_reason": None if lease.end_reason is None else str(lease.end_reason),
        "ended_at": None if lease.ended_at is None else lease.ended_at.isoformat(),
        "end_note": lease.end_note,
        "ttl": lease.ttl,
    }


def lease_in(data: dict[str, Any]) -> Lease:
    try:
        return Lease(
            key=str(data["key"]),
            owner=str(data["owner"]),
            counts={str(k): int(v) for k, v in data["counts"].items()},
            tokens={str(k): int(v) for k, v in data["tokens"].items()},
            acquired_at=datetime.fromisoformat(data["acquired_at"]),
            expires_at=datetime.fromisoformat(data["expires_at"]),
            expires_in=float(data["expires_in"]),
            end_reason=None if data.get("end_reason") is None else EndReason(data["end_reason"]),
            ended_at=None if data.get("ended_at") is None else datetime.fromisoformat(data["ended_at"]),
            end_note=None if data.get("end_note") is None else str(data["end_note"]),
            ttl=None if data.get("ttl") is None else float(data["ttl"]),  # an older service leaves it out
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _malformed("lease", exc) from exc


def semaphore_out(sem: Semaphore) -> dict[str, Any]:
    return {
        "name": sem.name,
        "capacity": sem.capacity,
        "used": sem.used,
        "available": sem.available,
        "last_token": str(sem.last_token),
        "fair": sem.fair,
        "created_at": sem.created_at.isoformat(),
        "updated_at": sem.updated_at.isoformat(),
    }


def semaphore_in(data: dict[str, Any]) -> Semaphore:
    try:
        return Semaphore(
            name=str(data["name"]),
            capacity=int(data["capacity"]),
            used=int(data["used"]),
            last_token=int(data["last_token"]),
            created_at=datetime.fromisoformat(data["created_at"]),
            updated_at=datetime.fromisoformat(data["updated_at"]),
            fair=bool(data.get("fair", False)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _malformed("semaphore", exc) from exc


def waiter_out(waiter: Waiter, *, show_key: bool = True) -> dict[str, Any]:
    return {**waiter.to_dict(), "key": waiter.key if show_key else None}


def waiter_in(data: dict[str, Any]) -> Waiter:
    try:
        return Waiter(
            key="" if data.get("key") is None else str(data["key"]),
            owner=str(data["owner"]),
            count=int(data["count"]),
            ticket=int(data["ticket"]),
            waiting_since=datetime.fromisoformat(data["waiting_since"]),
            place_expires_in=float(data["place_expires_in"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _malformed("waiter", exc) from exc


def holder_out(holder: Holder, *, show_key: bool = True) -> dict[str, Any]:
    return {
        # Another client's key is not shown to a client token: the service hides whose lease is whose.
        "key": holder.key if show_key else None,
        "owner": holder.owner,
        "count": holder.count,
        "token": str(holder.token),
        "acquired_at": holder.acquired_at.isoformat(),
        "expires_at": holder.expires_at.isoformat(),
        "expires_in": round(holder.expires_in, 3),
    }


def holder_in(data: dict[str, Any]) -> Holder:
    try:
        return Holder(
            key="" if data.get("key") is None else str(data["key"]),
            owner=str(data["owner"]),
            count=int(data["count"]),
            token=int(data["token"]),
            acquired_at=datetime.fromisoformat(data["acquired_at"]),
            expires_at=datetime.fromisoformat(data["expires_at"]),
            expires_in=float(data["expires_in"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _malformed("holder", exc) from exc


def change_out(change: CapacityChange) -> dict[str, Any]:
    return change.to_dict()


def change_in(data: dict[str, Any]) -> CapacityChange:
    try:
        return CapacityChange(
            name=str(data["name"]),
            old_capacity=None if data.get("old_capacity") is None else int(data["old_capacity"]),
            new_capacity=int(data["new_capacity"]),
            changed_by=str(data["changed_by"]),
            reason=str(data["reason"]),
            changed_at=datetime.fromisoformat(data["changed_at"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _malformed("capacity change", exc) from exc


def drift_out(drift: Drift) -> dict[str, Any]:
    return drift.to_dict()


def drift_in(data: dict[str, Any]) -> Drift:
    try:
        return Drift(
            name=str(data["name"]),
            recorded=int(data["recorded"]),
            actual=int(data["actual"]),
            repaired=bool(data.get("repaired", False)),
            field=str(data.get("field", "used")),  # servers before 0.x sent only count drift
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _malformed("drift", exc) from exc


def sweep_out(result: SweepResult) -> dict[str, Any]:
    return result.to_dict()


def sweep_in(data: dict[str, Any]) -> SweepResult:
    try:
        return SweepResult(
            leases=int(data["leases"]),
            batches=int(data["batches"]),
            keys=[(str(k["owner"]), str(k["key"])) for k in data.get("keys", [])],
            # A service older than the field does not say: taken as complete, as it was taken before.
            complete=bool(data.get("complete", True)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _malformed("sweep result", exc) from exc


def _malformed(what: str, exc: BaseException) -> ServiceError:
    return ServiceError(f"the service sent a malformed {what}: {type(exc).__name__}: {exc}")
