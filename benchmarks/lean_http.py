"""The leanest HTTP client this machine's Python has: the standard library's ``http.client`` on one
keep-alive connection, JSON in and out, nothing else (no connection pool, no URL or header models, no
retries but those a 503 or 429 asks for).

It stands for a light client in any language: the service's own Python client is built on httpx, which
costs the client process several times what a request costs here (docs/benchmarks.md, "The service
against the Redis semaphore, without the Python client's cost"). Measured beside it, the service's
figures say more of what the service does, and less of what its Python client costs.
"""

from __future__ import annotations

import http.client
import json
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

from harness import Scenario

#: A 503 or 429 is retried (after its Retry-After, with the same key) this many times, as permits' own
#: client does by default, before the cycle fails.
RETRIES = 5


class LeanHttp:
    """One keep-alive connection to ``url``."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=60)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any, float]:
        """Send one request and read the whole answer: (status, the JSON body or else its text, the
        seconds its Retry-After asks for, 0 without one)."""
        payload = None if body is None else json.dumps(body)
        headers = {} if body is None else {"content-type": "application/json"}
        try:
            self._connection.request(method, path, body=payload, headers=headers)
            response = self._connection.getresponse()
            data = response.read()
        except BaseException:
            # A connection cut mid-request stays in that state: start the next request on a new one.
            self._connection.close()
            raise
        kind = response.getheader("content-type") or ""
        answer = json.loads(data) if kind.startswith("application/json") else data.decode(errors="replace")
        return response.status, answer, float(response.getheader("retry-after") or 0)

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
        if status == 409 and isinstance(answer, dict) and answer.get("error", {}).get("code") == "acquire_timeout":
            return False
        if status != 201:
            raise RuntimeError(f"acquire answered {status}: {answer}")
        status, answer = self._send("/v1/leases/release", {"key": key, "owner": self._owner})
        if status != 200 or not isinstance(answer, dict) or answer.get("outcome") != "released":
            raise RuntimeError(f"release answered {status}: {answer}")
        return True

    def _send(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        for _ in range(RETRIES):
            status, answer, retry_after = self._http.request("POST", path, body)
            if status not in (429, 503):
                return status, answer
            time.sleep(retry_after)  # the same key: a retried acquire never grants twice
        raise RuntimeError(f"{path} answered {status} {RETRIES} times: {answer}")

    def close(self) -> None:
        self._http.close()
