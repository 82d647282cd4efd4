"""What a user's code type-checks as, under ``mypy --strict``: the forms the docs show for ``wants``, and the
types a holder names in its annotations, all from the package itself (py.typed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

USER_CODE = """
from __future__ import annotations

import permits


def take(client: permits.Client) -> None:
    client.acquire("backups")
    client.acquire(("backups", 2))  # one (name, count) pair
    client.acquire({"backups": 2, "db": 1})
    client.acquire([("backups", 2), "db", permits.Want("cpu", 4)])
    client.try_acquire(permits.shared("schema"), ttl=1)
    with client.lease(("backups", 2), keepalive=True) as lease:
        held: permits.Lease = lease
        print(held.tokens)


async def take_async(client: permits.AsyncClient, held: permits.AsyncHeld) -> None:
    await client.acquire(("backups", 2), timeout=5)
    dog: permits.AsyncWatchdog | None = held.watchdog
    print(dog)


def watch(held: permits.Held) -> permits.Watchdog | None:
    return held.watchdog
"""


def test_the_documented_forms_type_check_strictly(tmp_path: Path) -> None:
    script = tmp_path / "user.py"
    script.write_text(USER_CODE)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
