"""The leanest HTTP client this machine's Python has: the standard library's ``http.client`` on one
keep-alive connection, JSON in and out, nothing else (no connection pool, no retries but the one a
service's 503 asks for, no URL or header models).

It stands for a client in any language: the service's own Python client is built on httpx, which costs
the client process several times what the request costs here (docs/benchmarks.md, "The service and the
Redis semaphore"). Measured beside it, the service's figures then say what the service does, not what
its Python client costs.
"""

from __future__ import annotations

import http.client
import json
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

from harness import Scenario

#: A 503 (the service's pre-lock or database is slow) is retried after this long, with the same key.
RETRY_SECONDS = 0.05


class LeanHttp:
    """One keep-alive connection to ``url``."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=60)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """Send one request and read the whole answer: (status, the decoded JSON body)."""
        payload = None if body is None else json.dumps(body)
        headers = {} if body is None else {"content-type": "application/json"}
        self._connection.request(method, path, body=payload, headers=headers)
        response = self._connection.getresponse()
        return response.status, json.loads(response.read())

    def close(self) -> None:
        self._connection.close()


class LeanServiceClient:
    """A cycle through ``permits serve`` as any HTTP client would make it: ``POST /v1/leases`` with a long
    poll of ``wait`` seconds, then ``POST /v1/leases/release`` (docs/service.md). False when no permit
    came within the wait; any other refusal is an error of the run."""

    def __init__(self, url: str, scenario: Scenario, client_index: int, wait: float) -> None:
        self._http = LeanHttp(url)
        self._wants = [{"name": name, "count": 1} for name in scenario.semaphores_for(client_index)]
        self._owner = f"bench-{uuid.uuid4().hex[:8]}"
        self._wait = wait

    def cycle(self) -> bool:
        key = uuid.uuid4().hex
        body = {"wants": self._wants, "key": key, "owner": self._owner, "ttl": 60, "wait": self._wait}
        status, answer = self._send("/v1/leases", body)
        if status == 409 and answer["error"]["code"] == "acquire_timeout":
            return False
        if status != 201:
            raise RuntimeError(f"acquire answered {status}: {answer}")
        status, answer = self._send("/v1/leases/release", {"key": key, "owner": self._owner})
        if status != 200 or answer["outcome"] != "released":
            raise RuntimeError(f"release answered {status}: {answer}")
        return True

    def _send(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        while True:
            status, answer = self._http.request("POST", path, body)
            if status != 503:
                return status, answer
            time.sleep(RETRY_SECONDS)  # the same key: a retried acquire never grants twice

    def close(self) -> None:
        self._http.close()
