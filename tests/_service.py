"""Real ``permits serve`` processes for the tests: started on a free port, stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_LISTENING = re.compile(r"permits serving on (http://\S+?)(?:;| )")


class Service:
    """One ``permits serve`` process. Its output is kept, to show when a test fails."""

    def __init__(
        self,
        db_url: str,
        *,
        tokens: list[dict[str, Any]] | None = None,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
        module: str = "permits",
    ) -> None:
        """``module``: what ``python -m`` runs, ``permits`` or a test's launcher of it (tests/_clocked.py)."""
        environment = {**os.environ, **(env or {})}
        environment.pop("PERMITS_TOKEN", None)
        if tokens is not None:
            environment["PERMITS_TOKENS"] = json.dumps(tokens)
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, "serve", "--db", db_url, "--port", "0", *args],
            cwd=ROOT,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        found = threading.Event()
        self.url = ""

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.output.append(line)
                match = _LISTENING.search(line)
                if match and not found.is_set():
                    self.url = match.group(1)
                    found.set()
            found.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not found.wait(60) or not self.url:
            self.stop()
            raise RuntimeError("permits serve did not start:\n" + self.log())

    @classmethod
    def started(cls, db_url: str, **options: Any) -> Service:
        """A Service, started again (up to twice more) if its port was taken before it could bind it: with
        ``--port 0`` the port is chosen before uvicorn binds it, and another process (a test's TCP proxy
        opening connections, say) can take it in between, which CI met once."""
        for attempt in range(3):
            try:
                return cls(db_url, **options)
            except RuntimeError as exc:
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def log(self) -> str:
        return "".join(self.output[-200:])

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)
        return self.process.returncode


def module_db_url(backend: str, servers: Any, tmp_path_factory: Any, label: str) -> str:
    """The database a module's service runs on: a SQLite file of its own, or the shared server."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp(label) / 'permits.db'}"
    return str(servers.url_for(backend).render_as_string(hide_password=False))


@contextmanager
def running(db_url: str, **options: Any) -> Iterator[Service]:
    service = Service.started(db_url, **options)
    try:
        yield service
    finally:
        service.stop()


def metric(service: Service, name: str) -> float | None:
    """The value of one sample on the service's ``/metrics``, by its name and labels as written there."""
    import httpx

    for line in httpx.get(f"{service.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def wait_until(check: Any, timeout: float = 20.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {check}")
        time.sleep(interval)
