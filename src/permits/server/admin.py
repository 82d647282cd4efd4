"""Admin actions taken through the service, each written to ``permits_admin_log`` with who and why in the
action's own transaction: an action is never done without its record, nor recorded without being done.

The checks are the library client's (``_validate``); the flows are the library's own, wrapped by
``observe.audited``.
"""

from __future__ import annotations

from permits import _validate
from permits._core import flows, observe
from permits._core.flows import Stmt
from permits._exceptions import InvalidArgument
from permits._models import CapacityChange, Lease, Semaphore
from permits.server.auth import Identity
from permits.server.state import ServiceState


def _reason(reason: str | None, action: str, required: bool) -> str:
    text = _validate.reason("" if reason is None else reason)
    if required and not text.strip():
        raise InvalidArgument(f"{action} needs a reason", field="reason")
    return text


async def create_semaphore(
    state: ServiceState,
    identity: Identity,
    name: str,
    capacity: int,
    *,
    exist_ok: bool,
    fair: bool,
    who: str,
    reason: str | None,
) -> Semaphore:
    identity.require_admin("creating a semaphore")
    name, capacity, who = _validate.name(name), _validate.capacity(capacity), _validate.who(who)
    why = _reason(reason, "creating a semaphore", required=False)
    if not isinstance(fair, bool):
        raise InvalidArgument("fair must be true or false", field="fair")
    entry = observe.log_admin(identity.name, "create", name, why, f"capacity {capacity}" + (", fair" if fair else ""))
    sem: Semaphore = await state.sql_store.run_flow(
        # A semaphore found there already (exist_ok) was not created: nothing to record.
        lambda: observe.audited(
            flows.create_semaphore(name, capacity, who, bool(exist_ok), fair), entry, restart_does_nothing=True
        )
    )
    return sem


async def set_capacity(
    state: ServiceState, identity: Identity, name: str, capacity: int, *, reason: str, who: str
) -> CapacityChange:
    identity.require_admin("changing a capacity")
    name, capacity, who = _validate.name(name), _validate.capacity(capacity), _validate.who(who)
    why = _reason(reason, "a capacity change", required=True)
    entry = observe.log_admin(identity.name, "set_capacity", name, why, f"capacity {capacity}")
    change: CapacityChange = await state.sql_store.run_flow(
        lambda: observe.audited(flows.set_capacity(name, capacity, who, why), entry)
    )
    state.waker.notify([name])  # a raise makes room for this instance's waiters
    return change


async def delete_semaphore(
    state: ServiceState, identity: Identity, name: str, *, force: bool, reason: str | None
) -> int:
    identity.require_admin("deleting a semaphore")
    name = _validate.name(name)
    why = _reason(reason, "deleting a semaphore", required=False)
    entry = observe.log_admin(identity.name, "delete", name, why, "forced" if force else None)
    revoked: int = await state.sql_store.run_flow(
        lambda: observe.audited(flows.delete_semaphore(name, bool(force)), entry)
    )
    if revoked:
        state.metrics.reclaims.labels("revoked").inc(revoked)
    return revoked


async def revoke(state: ServiceState, identity: Identity, owner: str, key: str, *, reason: str) -> Lease:
    identity.require_admin("revoking a lease")
    why = _reason(reason, "a revoke", required=True)
    owner, key = _validate.owner(owner), _validate.key(key)
    # The note says who revoked it, where there are identities to tell apart.
    note = f"{identity.name}: {why}" if identity.scoped else why

    def entry(done: tuple[Lease, bool]) -> Stmt | None:
        lease, revoked = done
        if not revoked:
            return None
        # Under the semaphore's name when the lease has one, so that semaphore's page lists it.
        names = sorted(lease.counts)
        name = names[0] if len(names) == 1 else None
        detail = None if len(names) == 1 else "semaphores: " + ", ".join(names)
        return observe.log_admin(identity.name, "revoke", name, why, detail, lease_owner=owner, lease_key=key)

    # One that had ended already (or that a concurrent revoke ended) is answered unchanged: no action to
    # record.
    done: tuple[Lease, bool] = await state.sql_store.run_flow(
        lambda: observe.audited(flows.revoke_telling(owner, key, note), entry)
    )
    lease, revoked = done
    # Waiters are told whatever the answer: a retry after a lost reply answers "not this revoke" for a
    # revoke that did commit, and a needless wake-up costs a waiter one attempt.
    state.waker.notify(list(lease.counts))
    if revoked:
        state.metrics.reclaims.labels("revoked").inc()
    return lease
