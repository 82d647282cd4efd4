"""A process frozen inside its transaction (SIGSTOP: a debugger, a VM pause, a stuck GC) keeps its row
locks (on SQLite, the database's write lock) for as long as it is frozen. Others must still get an answer
within the timeout they asked for; and once it resumes, it finishes its own acquire as if nothing happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import permits
from permits import AcquireTimeout, ReleaseOutcome
from tests._children import spawn

TIMEOUT = 1.0
LOCK_WAIT = 1.0
#: on top of the caller's timeout: one lock wait that was already under way, and scheduling
SLACK = LOCK_WAIT + 1.5


@pytest.mark.slow
def test_acquire_timeout_holds_behind_a_frozen_transaction(db_url: str, ns: str, tmp_path: Path) -> None:
    a, b = f"{ns}a", f"{ns}b"
    child_owner, child_key = f"{ns}child", f"{ns}child-key"
    with permits.connect(db_url, owner=f"{ns}parent", lock_wait_timeout=LOCK_WAIT) as client:
        client.create_semaphore(a, 2)
        client.create_semaphore(b, 2)
        err = tmp_path / "child.err"
        with err.open("w") as err_file:
            proc = spawn(
                "operate",
                {
                    "url": db_url,
                    "owner": child_owner,
                    "key": child_key,
                    "op": "acquire",
                    "wants": {a: 1, b: 1},
                    "ttl": 60,
                    "stop_after": 1,  # frozen after its first statement, which took room on `a`
                },
                stdout=subprocess.PIPE,
                stderr=err_file,
            )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("stopping after"), f"the child did not freeze: {err.read_text()[-3000:]}"

            outcome = "granted"
            started = time.monotonic()
            try:
                waiter = client.acquire(a, key=f"{ns}waiter", timeout=TIMEOUT)
            except AcquireTimeout as exc:
                outcome = type(exc).__name__
            elapsed = time.monotonic() - started

            os.kill(proc.pid, signal.SIGCONT)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

        # The frozen process, resumed, completed its acquire.
        assert proc.returncode == 0, f"the resumed child exited {proc.returncode}: {err.read_text()[-3000:]}"
        child_lease = json.loads(out)["result"]
        assert child_lease["counts"] == {a: 1, b: 1}
        assert client.get_lease(child_key, owner=child_owner).held
        extra = 1 if outcome == "granted" else 0
        assert client.get_semaphore(a).used == 1 + extra
        assert client.get_semaphore(b).used == 1
        assert client.reconcile() == []
        assert client.release(child_key, owner=child_owner) == ReleaseOutcome.RELEASED
        if outcome == "granted":
            client.release(waiter)
        assert client.get_semaphore(a).used == 0

        # The waiter asked for an answer within TIMEOUT seconds.
        assert elapsed <= TIMEOUT + SLACK, (
            f"acquire(timeout={TIMEOUT}) with lock_wait_timeout={LOCK_WAIT} behind a frozen transaction took"
            f" {elapsed:.1f} s and ended with {outcome}"
        )
