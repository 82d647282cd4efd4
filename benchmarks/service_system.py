"""permits through its HTTP service, as a benchmark system (see the interface at the top of harness.py).

``setup`` starts one ``permits serve`` process in front of the backend, with the pre-lock on or off; each
client process talks to it with the public sync client over HTTP (``acquire(timeout=5)`` then ``release``), or,
with ``lean``, with the standard library's ``http.client`` (``lean_http.py``), as a client in any other
language would: the service's figures then leave out what its Python client costs.
While the clients run, the parent samples the service's /metrics for the database connections it has
checked out and the requests queued in its pre-lock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from harness import Scenario, stop_process
from lean_http import LeanServiceClient
from systems import PERMITS, WAIT_S, PermitsClient

_URL_FILE = Path(tempfile.gettempdir()) / "permits-bench-service.url"
_SAMPLED = ("permits_db_connections_in_use", "permits_prelock_waiting")


class ServiceSystem:
    def __init__(self, prelock: bool, lean: bool = False) -> None:
        self.prelock = prelock
        self.lean = lean
        self._process: subprocess.Popen[str] | None = None
        # One client for the samples, kept open: httpx.get makes a client each call, which cost this
        # process about 20 ms of CPU (its TLS context), ten times a second, on the cores the run measures.
        self._metrics: httpx.Client | None = None

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        PERMITS.setup(backend_url, scenario)  # fresh tables and the scenario's semaphores
        env = {
            **os.environ,
            "PERMITS_PRELOCK": "true" if self.prelock else "false",
            "PERMITS_MAINTENANCE__ENABLED": "false",
            "PERMITS_LIMITS__MAX_WAITERS": "100000",
        }
        env.pop("PERMITS_TOKENS", None)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "permits", "serve", "--db", backend_url, "--port", "0", "--log-level", "warning"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self._process.stdout is not None
        deadline = time.monotonic() + 60
        for line in self._process.stdout:
            if line.startswith("permits serving on "):
                url = line.split()[3].rstrip(";")
                _URL_FILE.write_text(url)
                break
            if time.monotonic() > deadline:
                break
        else:
            raise RuntimeError("permits serve did not start")

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> PermitsClient | LeanServiceClient:
        if self.lean:
            return LeanServiceClient(_URL_FILE.read_text(), scenario, client_index, wait=WAIT_S)
        # The same client as the direct system's: only the URL differs (the service's, over HTTP).
        return PermitsClient(_URL_FILE.read_text(), scenario.semaphores_for(client_index))

    def sample(self) -> dict[str, float]:
        if self._metrics is None:
            self._metrics = httpx.Client(base_url=_URL_FILE.read_text(), timeout=2)
        text = self._metrics.get("/metrics").text
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in _SAMPLED:
                values[name] = float(value)
        if self._process is not None:
            values["rss_mb"] = _resident_mb(self._process.pid)
        return values

    def server_pids(self) -> list[int]:
        return [] if self._process is None else [self._process.pid]

    def verify(self, backend_url: str, scenario: Scenario) -> list[str]:
        return PERMITS.verify(backend_url, scenario)

    def teardown(self, backend_url: str, scenario: Scenario) -> None:
        stop_process(self._process)
        self._process = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


def _resident_mb(pid: int) -> float:
    """The process's resident memory (VmRSS), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


PRELOCK_ON = ServiceSystem(prelock=True)
PRELOCK_OFF = ServiceSystem(prelock=False)
PRELOCK_ON_LEAN = ServiceSystem(prelock=True, lean=True)
