"""Property-based requests generated from the OpenAPI document (schemathesis, run as its own command)
against a real ``permits serve``: whatever a client sends, the service never answers with a 5xx, and its
answers match what the document says about them (status codes, bodies, content types)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests._service import running


def test_no_generated_request_makes_the_service_fail(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'permits.db'}"
    env = {"PERMITS_MAINTENANCE__ENABLED": "false", "PERMITS_LIMITS__MAX_WAIT": "0.2"}
    with running(url, env=env) as service:
        done = subprocess.run(
            [
                str(Path(sys.executable).with_name("schemathesis")),
                "run",
                f"{service.url}/openapi.json",
                "--checks",
                "not_a_server_error,response_schema_conformance,content_type_conformance,status_code_conformance",
                "--max-examples",
                os.environ.get("PERMITS_SCHEMATHESIS_EXAMPLES", "20"),
                "--seed",
                "20261122",
                # A live event stream never ends by design; tests/service/test_dashboard_api.py reads it.
                "--exclude-path",
                "/v1/events/stream",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
