"""A client of a permits service never imports SQLAlchemy: the CLI and the library run through a service with
the import made impossible. Importing it was most of the start-up of a `permits run` through a service (about
0.2 s of 0.45), and a process that only talks HTTP has no use for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import permits
from tests._service import running

#: Runs ``permits`` (the CLI) as ``python -m permits`` would, with every import of SQLAlchemy refused.
_CLI_WITHOUT_SQLALCHEMY = """
import sys
sys.modules["sqlalchemy"] = None  # from here on, any import of it raises ImportError
from permits.cli import main
sys.argv[0] = "permits"
main()
"""

#: The library, sync and asyncio, through the service named by its first argument.
_LIBRARY_WITHOUT_SQLALCHEMY = """
import asyncio, sys
sys.modules["sqlalchemy"] = None
import permits

with permits.connect(sys.argv[1]) as client:
    client.create_semaphore("lib", 2, exist_ok=True)
    with client.lease("lib", ttl=30, timeout=5) as lease:
        assert lease.token >= 1
    assert client.get_semaphore("lib").used == 0

async def main():
    async with permits.connect_async(sys.argv[1]) as client:
        lease = await client.acquire("lib", ttl=30, timeout=5)
        await client.release(lease)

asyncio.run(main())
print("ok")
"""


def _without_sqlalchemy(script: str, *args: str, url: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PERMITS_DATABASE_URL": url, "PERMITS_OWNER": "no-sqlalchemy"}
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=60
    )


def test_the_cli_through_a_service_never_imports_sqlalchemy(tmp_path: Path) -> None:
    with running(f"sqlite:///{tmp_path / 'service.db'}") as service:
        steps = [
            ("sem", "create", "jobs", "--capacity", "1"),
            ("run", "jobs", "--", sys.executable, "-c", "import os; print(os.environ['PERMITS_FENCING_TOKEN'])"),
            ("acquire", "jobs", "--key", "k1", "--ttl", "30"),
            ("release", "k1"),
            ("sem", "ls"),
            ("--help",),
        ]
        for step in steps:
            done = _without_sqlalchemy(_CLI_WITHOUT_SQLALCHEMY, *step, url=service.url, cwd=tmp_path)
            assert done.returncode == 0, f"permits {' '.join(step)} exited {done.returncode}: {done.stderr}"
        with permits.connect(service.url) as client:
            assert client.get_semaphore("jobs").used == 0


def test_the_library_through_a_service_never_imports_sqlalchemy(tmp_path: Path) -> None:
    with running(f"sqlite:///{tmp_path / 'service.db'}") as service:
        done = _without_sqlalchemy(_LIBRARY_WITHOUT_SQLALCHEMY, service.url, url=service.url, cwd=tmp_path)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_database_url_still_finds_sqlalchemy_missing_at_once(tmp_path: Path) -> None:
    """The check above is real: the same launcher on a database URL fails on the missing import."""
    done = _without_sqlalchemy(_CLI_WITHOUT_SQLALCHEMY, "sem", "ls", url=f"sqlite:///{tmp_path / 'x.db'}", cwd=tmp_path)
    assert done.returncode != 0 and "sqlalchemy" in done.stderr.lower()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        pytest.param("https://u:s3cret@h.example:8443/p", "https://u:***@h.example:8443/p", id="password"),
        pytest.param("http://h.example/p?Password=s3cret&a=1", "http://h.example/p?Password=***&a=1", id="query"),
        pytest.param("HTTP://H.example:8080", "http://h.example:8080", id="upper-case"),
        pytest.param("http://u@h.example", "http://u@h.example", id="user-without-password"),
    ],
)
def test_a_service_url_is_shown_without_its_secrets(url: str, shown: str) -> None:
    assert permits.connect(url).url == shown  # not opened: nothing listens there


def test_a_service_url_object_from_sqlalchemy_is_still_accepted() -> None:
    from sqlalchemy.engine import URL

    url = URL.create("http", username="u", password="s3cret", host="127.0.0.1", port=9)
    assert permits.connect(url).url == "http://u:***@127.0.0.1:9"
