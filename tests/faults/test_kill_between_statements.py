"""A process killed between any two statements of an operation leaves all of it or none of it.

For each operation, a first child runs it once with a counting hook (``SQLStore.after_statement``) to find
the N statements it runs on this backend. Then, for k = 1..N, a child runs the same operation from the same
starting state and SIGKILLs itself right after statement k (inside the transaction, except where one
statement is the whole operation and runs in autocommit, as PostgreSQL's one-semaphore acquire and its
release do); for k = N + 1 it SIGKILLs itself right after the operation returned (after the commit). The
statement counts differ per backend and path, so they are discovered, never hard-coded. After each death
the parent checks that the database holds either the whole operation or nothing of it, that the counts
agree with the permit rows, and that retrying with the same key grants at most once. (An acquire that
reclaims expired leases commits the reclaim first, in a transaction of its own: that one too is whole or
nothing.)
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import permits
from permits import EndReason, LeaseNotFound, ReleaseOutcome
from tests._children import spawn

#: Each child kills only itself, in its own namespace, and nothing here is timed but generous timeouts: these
#: run beside the other tests, not alone as the rest of tests/faults does.
pytestmark = pytest.mark.beside_others

TTL = 60
#: a lease that is meant to be expired by the time the child runs
STALE_TTL = 0.05

SCENARIOS = {
    # name: (operation, capacities by suffix, wants by suffix)
    "acquire-one": ("acquire", {"a": 2}, {"a": 1}),
    "acquire-two": ("acquire", {"a": 2, "b": 3}, {"a": 1, "b": 2}),
    # the semaphore is full with an expired lease: the acquire reclaims it in its own transaction
    "acquire-reclaim": ("acquire", {"a": 1}, {"a": 1}),
    "release-one": ("release", {"a": 2}, {"a": 1}),
    "release-two": ("release", {"a": 2, "b": 3}, {"a": 1, "b": 2}),
}


def _run_child(args: dict[str, Any], err: Path) -> tuple[int, str]:
    with err.open("w") as err_file:
        proc = spawn("operate", args, stdout=subprocess.PIPE, stderr=err_file)
        try:
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return proc.returncode, out


def _used(client: permits.Client, names: list[str]) -> dict[str, int]:
    return {name: client.get_semaphore(name).used for name in names}


def _holder_keys(client: permits.Client, name: str) -> list[str]:
    return [h.key for h in client.holders(name)]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_kill_after_each_statement(db_url: str, ns: str, scenario: str, tmp_path: Path) -> None:
    op, capacities, shorts = SCENARIOS[scenario]
    wants = {f"{ns}{s}": n for s, n in shorts.items()}
    names = sorted(wants)
    owner = f"{ns}child"  # the child's owner; the parent acts on the child's keys under the same owner
    reclaim = scenario == "acquire-reclaim"

    with permits.connect(db_url, owner=f"{ns}parent") as client:
        for s, capacity in capacities.items():
            client.create_semaphore(f"{ns}{s}", capacity)
        start = _used(client, names)

        def prepare(key: str) -> None:
            """Bring the database to the operation's starting state."""
            if op == "release":
                client.acquire(wants, key=key, owner=owner, ttl=TTL, timeout=5)
            elif reclaim:
                client.acquire(wants, key=f"{key}-stale", ttl=STALE_TTL, timeout=5)
                time.sleep(STALE_TTL * 2)

        def child_args(key: str, **kill: Any) -> dict[str, Any]:
            return {"url": db_url, "owner": owner, "key": key, "op": op, "wants": wants, "ttl": TTL, **kill}

        # Count the statements of one undisturbed run.
        prepare(f"{ns}count")
        code, out = _run_child(child_args(f"{ns}count"), tmp_path / "count.err")
        assert code == 0, (tmp_path / "count.err").read_text()[-3000:]
        statements = json.loads(out)["statements"]
        if reclaim:
            assert "LEASES_END" in statements, f"the acquire did not reclaim: {statements}"
        if op == "acquire":
            assert client.release(f"{ns}count", owner=owner) == ReleaseOutcome.RELEASED
        assert _used(client, names) == start
        n = len(statements)
        assert n >= 1

        for k in range(1, n + 2):
            key = f"{ns}k{k}"
            prepare(key)
            before = _used(client, names)
            kill = {"kill_after": k} if k <= n else {"kill_at_end": True}
            err = tmp_path / f"k{k}.err"
            code, out = _run_child(child_args(key, **kill), err)
            where = f"killed after statement {k} of {n} {statements}" if k <= n else "killed after it returned"
            assert code == -signal.SIGKILL, f"{where}: the child exited {code}: {out} {err.read_text()[-3000:]}"
            try:
                if op == "acquire":
                    _check_acquire(client, owner, key, wants, before, reclaim)
                else:
                    _check_release(client, owner, key, wants, before)
            except AssertionError as exc:
                raise AssertionError(f"{scenario}, {where}: {exc}") from exc
        assert _used(client, names) == start
        assert client.reconcile() == []


def _check_acquire(
    client: permits.Client, owner: str, key: str, wants: dict[str, int], before: dict[str, int], reclaim: bool
) -> None:
    names = sorted(wants)
    # With a reclaim, the stale lease (one permit of each) gives its permits back before the grant.
    granted = {name: before[name] + wants[name] - (1 if reclaim else 0) for name in names}
    stale = f"{key}-stale"

    # All or nothing.
    try:
        found: permits.Lease | None = client.get_lease(key, owner=owner)
    except LeaseNotFound:
        found = None
    if found is not None:
        assert found.counts == wants, f"the lease has permit rows for {found.counts}, not {wants}"
        assert found.held
        assert _used(client, names) == granted
        for name in names:
            assert _holder_keys(client, name).count(key) == 1
        if reclaim:
            assert client.get_lease(stale).end_reason == EndReason.EXPIRED
    else:
        for name in names:
            assert key not in _holder_keys(client, name)
        # The reclaim is a transaction of its own, committed before the grant's (lock order, flows.py's
        # _reclaim_then), as a sweep's would be: all of it or none of it, whatever happened to the grant.
        reclaimed = reclaim and client.get_lease(stale).end_reason == EndReason.EXPIRED
        if reclaim and not reclaimed:
            assert client.get_lease(stale).end_reason is None
        expected = {name: before[name] - (1 if reclaimed else 0) for name in names}
        assert _used(client, names) == expected, "no lease, yet the counts changed (beyond a committed reclaim)"
    assert client.reconcile() == []

    # A retry with the same key returns the lease that exists, or grants it now; never twice.
    retry = client.acquire(wants, key=key, owner=owner, ttl=TTL, timeout=5)
    again = client.acquire(wants, key=key, owner=owner, ttl=TTL, timeout=5)
    if found is not None:
        assert retry.tokens == found.tokens
    assert again.tokens == retry.tokens
    assert retry.counts == wants
    assert _used(client, names) == granted
    for name in names:
        assert _holder_keys(client, name).count(key) == 1
    if reclaim:
        assert client.get_lease(stale).end_reason == EndReason.EXPIRED
        assert _holder_keys(client, names[0]) == [key]
    assert client.reconcile() == []

    assert client.release(key, owner=owner) == ReleaseOutcome.RELEASED
    assert _used(client, names) == {name: granted[name] - wants[name] for name in names}


def _check_release(client: permits.Client, owner: str, key: str, wants: dict[str, int], before: dict[str, int]) -> None:
    names = sorted(wants)
    released = {name: before[name] - wants[name] for name in names}

    lease = client.get_lease(key, owner=owner)  # it was granted before the child ran: it exists
    assert lease.counts == wants
    if lease.end_reason is None:
        assert _used(client, names) == before, "the lease is held, yet the counts changed"
        for name in names:
            assert key in _holder_keys(client, name)
    else:
        assert lease.end_reason == EndReason.RELEASED
        assert _used(client, names) == released, "the lease was released, yet the counts did not follow"
        for name in names:
            assert key not in _holder_keys(client, name)
    assert client.reconcile() == []

    outcome = client.release(key, owner=owner)
    expected = ReleaseOutcome.RELEASED if lease.end_reason is None else ReleaseOutcome.ALREADY_RELEASED
    assert outcome == expected
    assert client.release(key, owner=owner) == ReleaseOutcome.ALREADY_RELEASED
    assert _used(client, names) == released
    assert client.get_lease(key, owner=owner).end_reason == EndReason.RELEASED
    assert client.reconcile() == []
