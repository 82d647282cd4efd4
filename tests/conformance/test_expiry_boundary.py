"""A lease at the very millisecond of its expiry. Every statement must agree on when a lease stops being
held: one that still let its holder release or extend it while another had already reclaimed its permit
would let two holders in. The rule is that a lease is held while ``expires_at > now`` and expired once
``now >= expires_at``, on the database's clock.

The database's clock is frozen for this. On SQLite the test runs in a child process under libfaketime with
a fixed wall clock (its monotonic clock runs, so timeouts work), since SQLite's clock is that process's, and
moves it by whole milliseconds with ``offset_clock``. A server's own clock cannot be frozen, so on MariaDB
and PostgreSQL the statements read the test's clock instead (``server_clock``), held still at one
millisecond after another with ``freeze``: the statements are production's, with the clock swapped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import permits
from permits.dialects.server_clock import server_offset_clock
from tests.conftest import own_database
from tests.faults.harness import LIBFAKETIME

CHILD = """
import json, sys
import permits
from permits.dialects.sqlite import offset_clock

seen = {}
moved = 0  # ms the test moved the clock
with offset_clock() as clock, permits.connect(sys.argv[1], auto_upgrade=True, owner="boundary") as client:

    def granted(name):
        client.create_semaphore(name, 1)
        return client.try_acquire(name, key=name + "-holder", ttl=1)  # expires 1,000 ms after its grant

    for step, (name, ms) in enumerate([("release", 999), ("release", 1000), ("extend", 999), ("extend", 1000),
                                        ("reclaim", 999), ("reclaim", 1000), ("sweep", 999), ("sweep", 1000)]):
        name = f"{name}-{ms}"
        lease = granted(name)
        if step == 0:
            first = lease.acquired_at
        # Frozen, the clock moved by what the test moved it, give or take the ms that julianday rounds off.
        seen.setdefault("clock stood still", True)
        drift_ms = abs((lease.acquired_at - first).total_seconds() * 1000 - moved)
        seen["clock stood still"] = seen["clock stood still"] and drift_ms <= 1
        clock.advance(ms / 1000)
        moved += ms
        if name.startswith("release"):
            seen[name] = str(client.release(lease))
        elif name.startswith("extend"):
            try:
                client.extend(lease, 30)
                seen[name] = "extended"
            except permits.LeaseLost:
                seen[name] = "lost"
        elif name.startswith("reclaim"):
            other = client.try_acquire(name, key=name + "-next", ttl=30)
            seen[name] = "granted to the next" if other is not None else "refused"
        else:
            seen[name] = client.sweep().leases
        clock.advance(60)  # the next case starts with every lease before it long expired
        moved += 60000
        client.sweep()
print(json.dumps(seen))
"""


#: What each case finds, a lease's TTL (1,000 ms) less 1 ms and exactly, after its grant.
EXPECTED = {
    "release-999": "released",
    "release-1000": "lost",
    "extend-999": "extended",
    "extend-1000": "lost",
    "reclaim-999": "refused",
    "reclaim-1000": "granted to the next",
    "sweep-999": 0,
    "sweep-1000": 1,
}


def test_a_lease_is_held_until_the_millisecond_of_its_expiry_and_no_longer(tmp_path: Path) -> None:
    if not os.path.exists(LIBFAKETIME):
        pytest.fail(f"{LIBFAKETIME} missing (apt-get install faketime)", pytrace=False)
    env = {
        **os.environ,
        "LD_PRELOAD": LIBFAKETIME,
        "FAKETIME": "2026-11-25 10:00:00",  # no "@": the wall clock stands still
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1",
        "TZ": "UTC",
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD, f"sqlite:///{tmp_path / 'permits.db'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"clock stood still": True, **EXPECTED}, seen


@pytest.mark.parametrize("backend", ["mysql", "postgresql"])
def test_on_a_server_a_lease_is_held_until_the_millisecond_of_its_expiry_and_no_longer(backend: str) -> None:
    """The same cases on MariaDB and PostgreSQL, in a database of the test's own (the sweeps must find only
    its leases), directly and, on PostgreSQL, through the server functions a pooled client calls."""
    with own_database(backend, "permits_boundary") as url:
        urls = [url] if backend == "mysql" else [url, f"{url}?pooler=transaction"]
        for index, client_url in enumerate(urls):
            with (
                server_offset_clock(url) as clock,
                permits.connect(client_url, auto_upgrade=True, owner="boundary") as client,
            ):
                now_ms = int(client.get_semaphore(_first(client, f"u{index}")).created_at.timestamp() * 1000)
                at = now_ms + 1000
                clock.freeze(at)
                seen: dict[str, object] = {}
                for case, ms in [(c.rsplit("-", 1)[0], int(c.rsplit("-", 1)[1])) for c in EXPECTED]:
                    name = f"{case}-{ms}-{index}"
                    client.create_semaphore(name, 1)
                    lease = client.try_acquire(name, key=f"{name}-holder", ttl=1)
                    assert lease is not None
                    assert int(lease.acquired_at.timestamp() * 1000) == at, "the clock did not stand still"
                    clock.freeze(at + ms)
                    if case == "release":
                        seen[f"{case}-{ms}"] = str(client.release(lease))
                    elif case == "extend":
                        try:
                            client.extend(lease, 30)
                            seen[f"{case}-{ms}"] = "extended"
                        except permits.LeaseLost:
                            seen[f"{case}-{ms}"] = "lost"
                    elif case == "reclaim":
                        other = client.try_acquire(name, key=f"{name}-next", ttl=30)
                        seen[f"{case}-{ms}"] = "granted to the next" if other is not None else "refused"
                    else:
                        seen[f"{case}-{ms}"] = client.sweep().leases
                    at += ms + 60_000  # the next case starts with every lease before it long expired
                    clock.freeze(at)
                    client.sweep()
                assert seen == EXPECTED, (client_url, seen)


def _first(client: permits.Client, name: str) -> str:
    """A semaphore created on the server's running clock, to read that clock from."""
    client.create_semaphore(name, 1)
    return name
