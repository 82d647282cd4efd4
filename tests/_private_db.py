"""Private MariaDB and PostgreSQL servers that a test starts, restarts and kills itself.

The shared servers on 3306 and 5432 belong to everyone's tests and must never be stopped. A test that
restarts or kills a database server gets one of its own instead: a fresh data directory in a temporary
directory, a free loopback port, the server's own durable defaults (``fsync=on``,
``synchronous_commit=on``; ``innodb_flush_log_at_trx_commit=1``), run as the ``postgres`` / ``mysql``
user in a session of its own; ``kill()`` SIGKILLs the server and every process it forked at once, as a
crash of its machine would::

    with PrivatePostgres() as db:           # initdb, then start; db.url: postgresql://postgres@127.0.0.1:<port>/permits
        ...
        db.restart()                        # a clean shutdown, then start again on the same port and data
        db.kill(); db.start()               # SIGKILL it and all its processes, then start: crash recovery
    # stopped and its directory removed

``private_postgresql`` and ``private_mariadb`` (module-scoped fixtures, see ``tests/faults/conftest.py``
for how they are imported) skip when the server binaries are missing, or fail with ``CI=true``.
Needs root (the servers run as their own users); the tests skip otherwise.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import pytest
from sqlalchemy import create_engine, text

PG_BIN = Path("/usr/lib/postgresql/15/bin")
MARIADB_INSTALL_DB = shutil.which("mariadb-install-db") or "/usr/bin/mariadb-install-db"
MARIADBD = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
#: how long a server may take to accept connections after start (crash recovery included), on a loaded box
START_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0


#: where test listeners get their ports: below Linux's ephemeral range (32768-60999 by default), so that no
#: outgoing connection (a TCP proxy's link to a database, a client's) can take a port between the moment a
#: test picks it and the moment its server binds it. CI once met that: "address already in use".
LISTEN_PORTS = range(20000, 32768)


def free_port() -> int:
    """A loopback port nothing listens on now, outside the ephemeral range (``LISTEN_PORTS``)."""
    for port in random.sample(LISTEN_PORTS, 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {LISTEN_PORTS}")


class PrivateServer:
    """One database server (and the processes it forks) on a data directory of its own. Subclasses say
    how to create, start and probe it."""

    user = ""
    kind = ""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"permits-{self.kind}-"))
        self.data = self.dir / "data"
        self.log_path = self.dir / "server.log"
        account = pwd.getpwnam(self.user)
        os.chown(self.dir, account.pw_uid, account.pw_gid)
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        #: (kind, time.monotonic()) of every start, stop, restart and kill, for the test's history
        self.events: list[tuple[str, float]] = []
        self._created = False
        self._init()

    # ---- to be provided

    def _init(self) -> None:
        raise NotImplementedError

    def _command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    def _admin_url(self) -> str:
        raise NotImplementedError

    def _probe(self) -> None:
        """Connect and answer; the first time, create the ``permits`` database that ``url`` names."""
        engine = create_engine(self._admin_url(), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
                if not self._created:
                    conn.execute(text("CREATE DATABASE permits"))
                    self._created = True
        finally:
            engine.dispose()

    # ---- control

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, "already running"
        log = self.log_path.open("ab")
        user = self.user if self.kind == "postgresql" else None  # mariadbd drops to --user=mysql itself
        self.process = subprocess.Popen(
            self._command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            user=user,
            cwd=self.dir,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.kind} exited {self.process.returncode} at start:\n{self.log_tail()}")
            try:
                self._probe()
                break
            except Exception:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"{self.kind} did not accept connections:\n{self.log_tail()}") from None
                time.sleep(0.1)
        self.events.append(("start", time.monotonic()))

    def stop(self) -> None:
        """A clean shutdown (PostgreSQL's fast mode, MariaDB's SIGTERM): in-flight transactions roll back,
        committed ones are on disk."""
        if self.process is None or self.process.poll() is not None:
            return
        self.events.append(("stop", time.monotonic()))
        self.process.send_signal(signal.SIGINT if self.kind == "postgresql" else signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server and every process it forked, at once, and wait until they are all gone.

        Not a process group kill: PostgreSQL puts each backend in a session of its own, and a backend that
        outlives its postmaster keeps the shared memory attached, so that a new postmaster refuses to start.
        The server is stopped (SIGSTOP) before its processes are listed, so that none it forks in between
        escapes the list: a backend forked for a connection at that moment once did, under load ("pre-existing
        shared memory block is still in use" at the next start).
        """
        if self.process is None:
            return
        self.events.append(("kill", time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGSTOP)
        doomed = [self.process.pid, *_descendants(self.process.pid)]
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + STOP_TIMEOUT
        while any(_alive(pid) for pid in doomed) and time.monotonic() < deadline:
            time.sleep(0.05)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrivateServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting to be reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class PrivatePostgres(PrivateServer):
    user = "postgres"
    kind = "postgresql"

    def _init(self) -> None:
        # --no-sync only skips initdb's own final fsync of the new directory; the server keeps fsync=on
        subprocess.run(
            [str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"],
            user=self.user,
            check=True,
            capture_output=True,
            cwd=self.dir,
        )

    def _command(self) -> list[str]:
        return [
            str(PG_BIN / "postgres"),
            "-D",
            str(self.data),
            "-p",
            str(self.port),
            "-k",
            str(self.dir),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "max_connections=200",
            "-c",
            "shared_buffers=32MB",
        ]

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/permits"

    def _admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"


class PrivateMariaDB(PrivateServer):
    user = "mysql"
    kind = "mariadb"
    #: more of mariadbd's options, for a subclass's server (a binary log, say)
    options: tuple[str, ...] = ()

    def _init(self) -> None:
        subprocess.run(
            [
                MARIADB_INSTALL_DB,
                "--no-defaults",
                f"--datadir={self.data}",
                "--user=mysql",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            check=True,
            capture_output=True,
            cwd=self.dir,
        )

    def _command(self) -> list[str]:
        return [
            MARIADBD,
            "--no-defaults",
            f"--datadir={self.data}",
            f"--socket={self.dir / 'mysqld.sock'}",
            f"--pid-file={self.dir / 'mysqld.pid'}",
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            "--user=mysql",
            "--skip-grant-tables",  # root@127.0.0.1 with no password, like the shared server
            "--skip-name-resolve",
            "--innodb-buffer-pool-size=64M",
            "--innodb-flush-log-at-trx-commit=1",  # the durable default, said out loud
            "--max-connections=200",
            *self.options,
        ]

    @property
    def url(self) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/permits"

    def _admin_url(self) -> str:
        return f"mysql+pymysql://root@127.0.0.1:{self.port}/mysql"


def _private(cls: type[PrivateServer]) -> Iterator[PrivateServer]:
    from tests.conftest import IN_CI

    problem = ""
    if os.geteuid() != 0:
        problem = "private database servers need root (they run as the postgres/mysql users)"
    elif cls is PrivatePostgres and not (PG_BIN / "postgres").exists():
        problem = f"PostgreSQL 15 binaries not found in {PG_BIN}"
    elif cls is PrivateMariaDB and not (Path(MARIADBD).exists() and Path(MARIADB_INSTALL_DB).exists()):
        problem = "mariadbd or mariadb-install-db not found"
    if problem:
        if IN_CI:
            pytest.fail(problem + " (CI=true)", pytrace=False)
        pytest.skip(problem)
    server = cls()
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def private_postgresql() -> Iterator[PrivateServer]:
    """A PostgreSQL server of this module's own, which its tests may restart and kill."""
    yield from _private(PrivatePostgres)


def private_server(cls: type[PrivateServer]) -> Iterator[PrivateServer]:
    """A server of ``cls`` (a subclass with options of its own), for a fixture: ``yield from`` it."""
    yield from _private(cls)


@pytest.fixture(scope="module")
def private_mariadb() -> Iterator[PrivateServer]:
    """A MariaDB server of this module's own, which its tests may restart and kill."""
    yield from _private(PrivateMariaDB)
