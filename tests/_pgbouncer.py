"""A real PgBouncer in front of the shared PostgreSQL, started by a test on a free loopback port.

    with PgBouncer("transaction", pool_size=3) as bouncer:
        url = bouncer.url_for("permits_pool_x")     # postgresql://postgres@127.0.0.1:<port>/permits_pool_x
        ...

``pool_size`` server connections per database and user, however many clients connect, all opened at
the first ``url_for`` and handed out in turn (``server_round_robin``): consecutive transactions of one
client connection then run on different server connections, which is what breaks prepared statements and
session settings behind a transaction pooler. (PgBouncer's default hands a lone client the connection it
used last, which hides both; an odd pool size keeps a client's grant and release from landing on the same
two connections in step.) The binary is Debian's ``pgbouncer`` (scripts/test installs it); PgBouncer
refuses to run as root, so it runs as the ``postgres`` user when the tests run as root.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import pytest
from sqlalchemy.engine import make_url

from tests._private_db import free_port
from tests.conftest import IN_CI, SERVER_URLS

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def pgbouncer_version() -> tuple[int, ...]:
    """The installed PgBouncer's version, e.g. (1, 18, 0); skips (fails in CI) when there is none."""
    if not Path(PGBOUNCER).exists():
        message = "no pgbouncer binary (apt-get install pgbouncer; scripts/test installs it as root)"
        if IN_CI:
            pytest.fail(message + " (CI=true: a missing pooler is a failure)", pytrace=False)
        pytest.skip(message)
    out = subprocess.run([PGBOUNCER, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"PgBouncer (\d+)\.(\d+)\.(\d+)", out)
    assert found, out
    return tuple(int(part) for part in found.groups())


class PgBouncer:
    def __init__(self, pool_mode: str, *, pool_size: int = 3) -> None:
        pgbouncer_version()
        server = make_url(SERVER_URLS["postgresql"])
        self.user = server.username or "postgres"
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self._warmed: set[str] = set()
        self.port = free_port()
        #: what this PgBouncer's server connections show in pg_stat_activity
        self.application_name = f"permits-pgbouncer-{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="permits-pgbouncer-"))
        self.dir.chmod(0o755)
        # Trust between the tests and PgBouncer; PgBouncer logs in to the server as the tests' URL says.
        (self.dir / "users.txt").write_text(f'"{self.user}" ""\n')
        password = f" password={server.password}" if server.password else ""
        target = f"host={server.host or '127.0.0.1'} port={server.port or 5432} user={self.user}{password}"
        (self.dir / "pgbouncer.ini").write_text(
            f"""[databases]
* = {target} application_name={self.application_name}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir / "users.txt"}
pool_mode = {pool_mode}
default_pool_size = {pool_size}
max_client_conn = 500
; hand a client the server connection idle longest, not the one it used last: consecutive transactions of
; one client then run on different server connections, as they do on a busy pooler
server_round_robin = 1
"""
        )
        for path in self.dir.iterdir():
            path.chmod(0o644)
        self.log_path = self.dir / "pgbouncer.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Start it (again) on its port, and return once it accepts connections."""
        assert self.process is None or self.process.poll() is not None, "already running"
        user = "postgres" if os.geteuid() == 0 else None
        if user is not None:
            pwd.getpwnam(user)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [PGBOUNCER, str(self.dir / "pgbouncer.ini")],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                user=user,
            )
        deadline = time.monotonic() + 20
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited {self.process.returncode} at start:\n{self.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not listen:\n{self.log_tail()}") from None
                time.sleep(0.05)
        self._warmed.clear()

    def kill(self) -> None:
        """SIGKILL it: every client and server connection it holds drops at once, transactions in flight
        included (the server rolls back those not committed yet)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def url_for(self, database: str, **query: str) -> str:
        """A URL through this PgBouncer, whose pool for ``database`` holds all its server connections."""
        plain = f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"
        if database not in self._warmed:
            self._warm(plain)
            self._warmed.add(database)
        params = "&".join(f"{name}={value}" for name, value in query.items())
        return plain + (f"?{params}" if params else "")

    def _warm(self, url: str) -> None:
        """Open every server connection of the pool now, with as many transactions at once: PgBouncer opens
        one only when all the others are busy, so a lone client would otherwise stay on one of them."""
        import psycopg

        held = [psycopg.connect(url, connect_timeout=10) for _ in range(self.pool_size)]
        try:
            for conn in held:
                conn.execute("SELECT 1")  # each in a transaction of its own, kept open until all are
            for conn in held:
                conn.rollback()  # a server connection left inside a transaction would be dropped, not pooled
        finally:
            for conn in held:
                conn.close()

    def log_tail(self) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
