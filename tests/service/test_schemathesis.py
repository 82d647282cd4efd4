"""Property-based requests generated from the OpenAPI document (schemathesis, run as its own command, with
every check it has) against a real ``permits serve``: whatever a client sends, the service never answers
with a 5xx; its answers match what the document says about them (status codes, bodies, content types,
``Allow`` on a 405); it takes every request the document calls valid, and refuses every one it calls
invalid. Run in open mode, and with tokens as an admin and as a client (whose owners are scoped), on SQLite; as
an admin on MariaDB and PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import permits
from tests._service import running
from tests.conftest import own_database

ADMIN, CLIENT = "schemathesis-admin-0123456789", "schemathesis-client-0123456789"
TOKENS = [{"name": "ops", "token": ADMIN, "admin": True}, {"name": "app", "token": CLIENT}]


@pytest.mark.parametrize("token", [None, ADMIN, CLIENT], ids=["open-mode", "admin-token", "client-token"])
@pytest.mark.slow
def test_no_generated_request_makes_the_service_fail(tmp_path: Path, token: str | None) -> None:
    _run_schemathesis(f"sqlite:///{tmp_path / 'permits.db'}", token, tmp_path)


@pytest.mark.parametrize("backend", ["mysql", "postgresql"])
@pytest.mark.slow
def test_no_generated_request_makes_the_service_fail_on_a_server(tmp_path: Path, backend: str) -> None:
    """The same, as an admin, on MariaDB and PostgreSQL, each in a database of its own: what their drivers
    and columns refuse (a string too long, a character a column cannot hold) must be a 4xx there too."""
    with own_database(backend, "permits_schemathesis") as url:
        with permits.connect(url, auto_upgrade=True) as client:
            client.list_semaphores()  # the schema, made directly: a service does not create it on a server
        _run_schemathesis(url, ADMIN, tmp_path)


def _run_schemathesis(url: str, token: str | None, tmp_path: Path) -> None:
    env = {"PERMITS_MAINTENANCE__ENABLED": "false", "PERMITS_LIMITS__MAX_WAIT": "0.2"}
    auth = [] if token is None else ["--header", f"Authorization: Bearer {token}"]
    with running(url, env=env, **({} if token is None else {"tokens": TOKENS})) as service:
        done = subprocess.run(
            [
                str(Path(sys.executable).with_name("schemathesis")),
                "--config-file",
                str(Path(__file__).with_name("schemathesis.toml")),
                "run",
                f"{service.url}/openapi.json",
                *auth,
                "--max-examples",
                os.environ.get("PERMITS_SCHEMATHESIS_EXAMPLES", "20"),
                "--seed",
                os.environ.get("PERMITS_SCHEMATHESIS_SEED", "20261122"),
                # A live event stream never ends by design; tests/service/test_dashboard_api.py reads it.
                "--exclude-path",
                "/v1/events/stream",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
            # the hooks module with our own check (tests/service/schemathesis_checks.py)
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
