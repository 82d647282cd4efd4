"""The floor for any HTTP lock service on this machine, as benchmark systems (see harness.py).

One uvicorn process (with httptools and uvloop, as ``permits serve`` runs it) serves two endpoints that
answer at once and touch no database: ``POST /v1/leases`` and ``DELETE /v1/leases/{key}``. Each client
process loops over both. A cycle costs what two requests cost in the client, the kernel and the server,
and nothing else. Two pairs:

- ``HTTP_FLOOR`` (``null-http``): permits' own stack, FastAPI in the server and httpx in the clients (the
  library permits' remote client uses). No service built on this stack can do more cycles per second on
  this machine, with the clients on the same cores.
- ``LEAN_HTTP_FLOOR`` (``null-http-lean``): the leanest pair Python has, a bare ASGI function in the
  server and the standard library's ``http.client`` in the clients (``lean_http.py``): a practical
  ceiling for one uvicorn process on this machine, with light clients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from harness import Scenario, free_port, stop_process
from lean_http import LeanHttp

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


async def bare_app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def, type-arg]
    """The same two endpoints as a bare ASGI function: no routing, validation or response models."""
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if scope["method"] == "POST":
        answer = json.dumps({"key": json.loads(body).get("key"), "tokens": {"x": "1"}}).encode()
    else:
        answer = b'{"outcome": "released"}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


class HttpFloorSystem:
    def __init__(self, lean: bool = False) -> None:
        self.lean = lean
        self._process: subprocess.Popen[bytes] | None = None

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        port = free_port()
        here = str(Path(__file__).resolve().parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
        app = ["http_floor:bare_app"] if self.lean else ["--factory", "http_floor:create_app"]
        command = [sys.executable, "-m", "uvicorn", *app, "--port", str(port)]
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

    def make_client(
        self, backend_url: str, scenario: Scenario, client_index: int
    ) -> HttpFloorClient | LeanHttpFloorClient:
        url = _URL_FILE.read_text()
        return LeanHttpFloorClient(url) if self.lean else HttpFloorClient(url)

    def server_pids(self) -> list[int]:
        return [] if self._process is None else [self._process.pid]

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


class LeanHttpFloorClient:
    def __init__(self, url: str) -> None:
        self._lean = LeanHttp(url)

    def cycle(self) -> bool:
        key = uuid.uuid4().hex
        status, _, _ = self._lean.request("POST", "/v1/leases", {"wants": {"x": 1}, "key": key, "ttl": 60})
        if status == 200:
            status, _, _ = self._lean.request("DELETE", f"/v1/leases/{key}")
        if status != 200:
            raise RuntimeError(f"the null service answered {status}")
        return True

    def close(self) -> None:
        self._lean.close()


HTTP_FLOOR = HttpFloorSystem()
LEAN_HTTP_FLOOR = HttpFloorSystem(lean=True)
