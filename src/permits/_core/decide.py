"""Pure decisions over plain rows: what a lease looks like, whether a retry replays, what a release found."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from permits._exceptions import CountExceedsCapacity, IdempotencyConflict, KeyInUse, LeaseLost
from permits._models import EndReason, Holder, Lease, ReleaseOutcome, Semaphore, Waiter, Want, ms_to_datetime

#: lease.state values: a lease is held (1) until it ends (0), and never comes back.
HELD = 1
ENDED = 0


def lease_from_rows(rows: Sequence[Sequence[Any]], owner: str, key: str) -> Lease | None:
    """Build a lease from the rows of ``LEASE_FIND`` (one row per semaphore of the lease).

    Columns: id, state, end_reason, acquired_at_ms, expires_at_ms, ended_at_ms, now_ms, name, count, token,
    end_note, ttl_ms (and request_id, which the lease does not show: see ``replay``).
    """
    if not rows:
        return None
    first = rows[0]
    _, state, end_reason, acquired_ms, expires_ms, ended_ms, now_ms = first[:7]
    counts = {str(r[7]): int(r[8]) for r in rows}
    tokens = {str(r[7]): int(r[9]) for r in rows}
    return Lease(
        key=key,
        owner=owner,
        counts=dict(sorted(counts.items())),
        tokens=dict(sorted(tokens.items())),
        acquired_at=ms_to_datetime(int(acquired_ms)),
        expires_at=ms_to_datetime(int(expires_ms)),
        expires_in=(int(expires_ms) - int(now_ms)) / 1000,
        end_reason=None if int(state) == HELD else EndReason(str(end_reason)),
        ended_at=None if ended_ms is None else ms_to_datetime(int(ended_ms)),
        end_note=None if len(first) < 11 or first[10] is None else str(first[10]),
        ttl=None if len(first) < 12 or first[11] is None else int(first[11]) / 1000,
    )


def replay(existing: Lease, wants: Sequence[Want], new_only: bool = False, own: bool = False) -> Lease:
    """An acquire found a lease under its key already: this is a retry. Answer it without granting twice.

    The same request gets the same lease back, as long as it is still held; a different request under the
    same key is a conflict, and a lease that has ended cannot be handed out again. A request for a new lease
    only (``new_only``) is answered with the lease only if it is its ``own``: the lease records the id of the
    request that got it, which a try whose reply was lost shares with the retry. Any other lease under the
    key is another caller's that used the same key (two ``permits run --key K`` at once): ``KeyInUse``.
    """
    if new_only and not own:
        state = "held" if existing.held else f"ended ({existing.end_reason or 'expired'})"
        raise KeyInUse(
            f"key {existing.key!r} names a lease already, {state}: a request for a new lease under it is refused",
            key=existing.key,
            owner=existing.owner,
            held=existing.held,
        )
    asked = {w.name: w.count for w in wants}
    if asked != existing.counts:
        raise IdempotencyConflict(
            f"key {existing.key!r} was used for a different request ({_describe(existing.counts)})",
            key=existing.key,
            owner=existing.owner,
        )
    ensure_held(existing)
    return existing


def ensure_held(lease: Lease) -> None:
    """Raise ``LeaseLost`` when the lease has ended or its TTL has passed on the database's clock."""
    if lease.end_reason is not None:
        raise LeaseLost(
            f"lease {lease.key!r} has ended ({lease.end_reason})",
            key=lease.key,
            owner=lease.owner,
            reason=str(lease.end_reason),
        )
    if lease.expires_in <= 0:
        raise LeaseLost(
            f"lease {lease.key!r} expired {-lease.expires_in:.3f} s ago",
            key=lease.key,
            owner=lease.owner,
            reason=str(EndReason.EXPIRED),
        )


def release_outcome(lease: Lease | None) -> ReleaseOutcome:
    """What to tell a caller whose release changed nothing, from the lease as it is now."""
    if lease is None:
        return ReleaseOutcome.NOT_FOUND
    if lease.end_reason == EndReason.RELEASED:
        return ReleaseOutcome.ALREADY_RELEASED
    return ReleaseOutcome.LOST


def check_counts(wants: Sequence[Want], capacities: dict[str, int]) -> None:
    """A want for more than a semaphore's capacity could never be granted: say so instead of waiting."""
    for want in wants:
        cap = capacities.get(want.name)
        if cap is not None and want.count > cap:
            raise CountExceedsCapacity(
                f"asked for {want.count} permits of {want.name!r}, whose capacity is {cap}",
                name=want.name,
                count=want.count,
                capacity=cap,
                field="count",
            )


def has_room(want: Want, capacity: int, used: int) -> bool:
    return used + want.count <= capacity


def semaphore_from_row(row: Sequence[Any]) -> Semaphore:
    """Columns: name, capacity, used, last_token, created_at_ms, updated_at_ms, fair."""
    name, capacity, used, last_token, created_ms, updated_ms = row[:6]
    return Semaphore(
        name=str(name),
        capacity=int(capacity),
        used=int(used),
        last_token=int(last_token),
        created_at=ms_to_datetime(int(created_ms)),
        updated_at=ms_to_datetime(int(updated_ms)),
        fair=len(row) > 6 and bool(int(row[6])),
    )


def waiter_from_row(row: Sequence[Any]) -> Waiter:
    """Columns: owner, lease_key, count, ticket, enqueued_at_ms, expires_at_ms, now_ms."""
    owner, key, count, ticket, enqueued_ms, expires_ms, now_ms = row[:7]
    return Waiter(
        key=str(key),
        owner=str(owner),
        count=int(count),
        ticket=int(ticket),
        waiting_since=ms_to_datetime(int(enqueued_ms)),
        place_expires_in=(int(expires_ms) - int(now_ms)) / 1000,
    )


def holder_from_row(row: Sequence[Any]) -> Holder:
    """Columns: owner, lease_key, count, token, acquired_at_ms, expires_at_ms, now_ms."""
    owner, key, count, token, acquired_ms, expires_ms, now_ms = row[:7]
    return Holder(
        key=str(key),
        owner=str(owner),
        count=int(count),
        token=int(token),
        acquired_at=ms_to_datetime(int(acquired_ms)),
        expires_at=ms_to_datetime(int(expires_ms)),
        expires_in=(int(expires_ms) - int(now_ms)) / 1000,
    )


def _describe(counts: dict[str, int]) -> str:
    return ", ".join(f"{name}:{count}" for name, count in sorted(counts.items()))
