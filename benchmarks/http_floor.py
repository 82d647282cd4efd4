"""The floor for any HTTP lock service on this machine, as a benchmark system (see harness.py).

One uvicorn process serves the same stack as ``permits serve`` (uvicorn with httptools and uvloop,
FastAPI, JSON bodies) with two endpoints that answer at once and touch no database: ``POST /v1/leases``
and ``DELETE /v1/leases/{key}``. Each client process loops over both with httpx, the library permits'
own remote client uses. A cycle here costs what two requests cost in the client, the kernel and the
server, and nothing else: no service built on this stack can do more cycles per second on this machine,
with the clients on the same cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from harness import Scenario, free_port, stop_process

_URL_FILE = Path(tempfile.gettempdir()) / "permits-bench-http-floor.url"


def create_app():  # type: ignore[no-untyped-def]
    """The null service (imported by uvicorn in the server process)."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/leases")
    async def acquire(body: dict) -> dict:  # type: ignore[type-arg]
        return {"key": body.get("key"), "tokens": {"x": "1"}}

    @app.delete("/v1/leases/{key}")
    async def release(key: str) -> dict:  # type: ignore[type-arg]
        return {"outcome": "released"}

    return app


class HttpFloorSystem:
    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        port = free_port()
        here = str(Path(__file__).resolve().parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "uvicorn", "--factory", "http_floor:create_app", "--port", str(port)]
        self._process = subprocess.Popen([*command, "--log-level", "warning", "--no-access-log"], env=env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.delete(f"{url}/v1/leases/probe", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or self._process.poll() is not None:
                    raise RuntimeError("the null HTTP service did not start") from None
                time.sleep(0.1)
        _URL_FILE.write_text(url)

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> HttpFloorClient:
        return HttpFloorClient(_URL_FILE.read_text())

    def teardown(self, backend_url: str, scenario: Scenario) -> None:
        stop_process(self._process)
        self._process = None


class HttpFloorClient:
    def __init__(self, url: str) -> None:
        self._http = httpx.Client(base_url=url, timeout=30)

    def cycle(self) -> bool:
        key = uuid.uuid4().hex
        self._http.post("/v1/leases", json={"wants": {"x": 1}, "key": key, "ttl": 60}).raise_for_status()
        self._http.delete(f"/v1/leases/{key}").raise_for_status()
        return True

    def close(self) -> None:
        self._http.close()


HTTP_FLOOR = HttpFloorSystem()
