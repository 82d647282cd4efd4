"""Property-based requests generated from the OpenAPI document (schemathesis, run as its own command, with
every check it has) against a real ``permits serve``: whatever a client sends, the service never answers
with a 5xx; its answers match what the document says about them (status codes, bodies, content types,
``Allow`` on a 405); it takes every request the document calls valid, and refuses every one it calls
invalid. Run in open mode, and with tokens as an admin and as a client (whose owners are scoped)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._service import running

ADMIN, CLIENT = "schemathesis-admin-0123456789", "schemathesis-client-0123456789"
TOKENS = [{"name": "ops", "token": ADMIN, "admin": True}, {"name": "app", "token": CLIENT}]


@pytest.mark.parametrize("token", [None, ADMIN, CLIENT], ids=["open-mode", "admin-token", "client-token"])
def test_no_generated_request_makes_the_service_fail(tmp_path: Path, token: str | None) -> None:
    url = f"sqlite:///{tmp_path / 'permits.db'}"
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
