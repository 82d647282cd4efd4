"""Which file a SQLite URL's writers write, for the lines kept beside it (stores/host_lines.py): every
client of one file must find the same lines, however its URL names the file."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

import permits
from permits.dialects.sqlite import database_file


@pytest.mark.parametrize(
    ("url", "written"),
    [
        ("sqlite:////srv/p.db", "/srv/p.db"),
        ("sqlite:///p.db", "p.db"),
        ("sqlite:///file:/srv/p.db?uri=true", "/srv/p.db"),
        ("sqlite:///file:///srv/p.db?uri=true", "/srv/p.db"),
        ("sqlite:///file://localhost/srv/p.db?mode=rwc&uri=true", "/srv/p.db"),
        ("sqlite:///file:/srv/my%2520p.db?uri=true", "/srv/my p.db"),  # SQLite decodes what is left encoded
        # Without uri=true the name is a path like any other (SQLAlchemy makes it absolute).
        ("sqlite:///file:/srv/p.db", "file:/srv/p.db"),
        # Nothing written, or nothing shared: no lines.
        ("sqlite://", None),
        ("sqlite:///:memory:", None),
        ("sqlite:///file::memory:?cache=shared&uri=true", None),
        ("sqlite:///file:shared?mode=memory&cache=shared&uri=true", None),
        ("sqlite:///file:/srv/p.db?mode=ro&uri=true", None),
        ("sqlite:///file:/srv/p.db%3Fmode=ro?uri=true", None),  # a query in the path, as SQLite reads it
        ("sqlite:///file://elsewhere/srv/p.db?uri=true", None),  # SQLite opens no other host's file
        ("sqlite:///file:/shared?vfs=memdb&uri=true", None),  # in memory, named for the process to share
    ],
)
def test_the_file_a_url_writes(url: str, written: str | None) -> None:
    assert database_file(make_url(url)) == written


def test_a_file_uri_keeps_the_lines_of_its_file(tmp_path: Path) -> None:
    """A store opened with a file: URI keeps its writers in line with those of a plain path to the same
    file: both use the one lines file beside it. The URI's had none before, and its writers took SQLite's
    lock unordered (docs/benchmarks.md, "Lines for SQLite")."""
    path = tmp_path / "uri.db"
    with (
        permits.connect(f"sqlite:///{path}") as plain,
        permits.connect(f"sqlite:///file:{path}?mode=rwc&uri=true") as uri,
    ):
        plain.create_semaphore("s", 1)
        for client in (plain, uri):
            lines = client._store._direct.lines
            assert lines is not None and lines.path == f"{path}-permits-lines"
        lease = uri.acquire("s", ttl=60, timeout=5)
        uri.release(lease)
    assert (tmp_path / "uri.db-permits-lines").exists()
