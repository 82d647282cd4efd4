"""A holder dies without releasing: its permits come back when its TTL passes, and not before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

import permits
from permits import EndReason, ReleaseOutcome
from tests._children import spawn

TTL = 1.5
#: how much earlier than the TTL the new grant may be seen by the parent: the parent starts its clock when
#: it reads the child's "held" line, a little after the grant committed
EARLY_SLACK = 0.3


@pytest.mark.slow
def test_killed_holder_is_reclaimed_after_its_ttl(db_url: str, ns: str, tmp_path: Path) -> None:
    name = f"{ns}m"
    child_owner, child_key = f"{ns}child", f"{ns}child-key"
    with permits.connect(db_url, owner=f"{ns}parent") as client:
        client.create_mutex(name)
        err = tmp_path / "child.err"
        with err.open("w") as err_file:
            proc = spawn(
                "hold",
                {"url": db_url, "owner": child_owner, "key": child_key, "wants": name, "ttl": TTL},
                stdout=subprocess.PIPE,
                stderr=err_file,
            )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            held_seen = time.monotonic()
            assert line.startswith("held "), f"the child did not acquire: {err.read_text()[-2000:]}"
            child_lease = json.loads(line.removeprefix("held "))
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=10) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

        # The dead holder's lease has not expired yet: no room.
        assert client.try_acquire(name, key=f"{ns}too-early") is None
        assert client.get_semaphore(name).used == 1
        assert [h.key for h in client.holders(name)] == [child_key]

        # Waiting works: the acquiring transaction reclaims the expired lease.
        lease = client.acquire(name, key=f"{ns}after", ttl=30, timeout=5)
        granted_seen = time.monotonic()
        assert granted_seen - held_seen >= TTL - EARLY_SLACK, (
            f"granted {granted_seen - held_seen:.3f} s after the holder was seen, before its {TTL} s TTL"
        )
        # On the database's own clock, the new grant is not earlier than the old lease's expiry.
        assert lease.acquired_at >= datetime.fromisoformat(child_lease["expires_at"])
        assert lease.token > child_lease["tokens"][name]

        dead = client.get_lease(child_key, owner=child_owner)
        assert dead.end_reason == EndReason.EXPIRED
        assert not dead.held
        assert dead.tokens == child_lease["tokens"]
        assert [h.key for h in client.holders(name)] == [lease.key]
        assert client.get_semaphore(name).used == 1
        assert client.reconcile() == []

        # The dead holder's key, released late, reports that it lost the lease; nothing changes.
        assert client.release(child_key, owner=child_owner) == ReleaseOutcome.LOST
        assert client.release(lease) == ReleaseOutcome.RELEASED
        assert client.get_semaphore(name).used == 0
        assert client.reconcile() == []
