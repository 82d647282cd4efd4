"""Redis, ZooKeeper and etcd for the peer benchmarks, and PgBouncer for permits behind a pooler: use one
that is reachable, or start a private one.

``REDIS.ensure()``, ``ZOOKEEPER.ensure()`` and ``ETCD.ensure()`` run in the benchmark's parent process
(from a system's ``setup``). Each returns the ``host:port`` of a server, in this order of preference:

1. the one named by its environment variable (``PERMITS_BENCH_REDIS``, ``PERMITS_BENCH_ZOOKEEPER``,
   ``PERMITS_BENCH_ETCD``);
2. one answering on the usual local port (6379, 2181, 2379);
3. a private standalone server started from Debian's packages (``redis-server``, ``zookeeper``,
   ``etcd-server``) on a free loopback port with a temporary data directory.

PgBouncer (``PGBOUNCER.ensure()``, ``PERMITS_BENCH_PGBOUNCER``) skips step 2: it must pool the benchmark's
own PostgreSQL server, which its system names in ``PGBOUNCER.target`` first.

The address is then put in the environment variable, so the client processes (started later, and
handed the parent's environment by the harness) find the same server. A private server is started once
per parent process, not once per run (a JVM takes seconds to start), and stopped with its data directory
when the parent exits. It is also told to die with the parent, so an interrupted report leaves nothing running.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from harness import free_port, stop_process

START_TIMEOUT_SECONDS = 60


def _accepts_connections(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask Linux to send SIGTERM when the parent dies, so a
    # benchmark killed mid-run does not leave a JVM or an etcd behind.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class PrivateServer:
    """One kind of server: how to find it, and how to start a private one."""

    env_var: str
    default_port: int
    package: str  # the Debian package that provides it, for the error message

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._data_dir: str | None = None

    def command(self, port: int, data_dir: str) -> list[str]:
        raise NotImplementedError

    def run_as(self) -> str | None:
        """The user to run the server as (None: this process's own)."""
        return None

    def address(self, port: int) -> str:
        return f"127.0.0.1:{port}"

    def is_ready(self, port: int) -> bool:
        return _accepts_connections("127.0.0.1", port)

    def ensure(self) -> str:
        address = os.environ.get(self.env_var)
        if not address:
            address = self.address(self.default_port) if self.is_ready(self.default_port) else self._start()
            os.environ[self.env_var] = address
        return address

    def _start(self) -> str:
        port = free_port()
        self._data_dir = tempfile.mkdtemp(prefix=f"permits-bench-{self.package}-")
        try:
            command = self.command(port, self._data_dir)
        except FileNotFoundError as exc:
            raise RuntimeError(f"{exc}: install it with `apt-get install {self.package}`") from exc
        log = open(os.path.join(self._data_dir, "server.log"), "wb")  # noqa: SIM115 - closed with the process
        self._process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
            user=self.run_as(),
        )
        log.close()  # the child has its own copy
        atexit.register(self.stop)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not self.is_ready(port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                output = self._read_log()
                self.stop()
                raise RuntimeError(f"private {self.package} server did not start:\n{output}")
            time.sleep(0.1)
        return self.address(port)

    def _read_log(self) -> str:
        assert self._data_dir is not None
        with contextlib.suppress(OSError), open(os.path.join(self._data_dir, "server.log"), errors="replace") as f:
            return f.read()[-3000:]
        return ""

    def stop(self) -> None:
        stop_process(self._process, grace=10)
        self._process = None
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None


def _require(path: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing")
    return path


def _program(name: str) -> str:
    """The path of the program ``name``: on PATH, or in /usr/bin where Debian puts it (PATH may be short)."""
    return shutil.which(name) or _require(f"/usr/bin/{name}")


class RedisServer(PrivateServer):
    """Debian's redis-server with its defaults for persistence: snapshots now and then, no append-only file."""

    env_var = "PERMITS_BENCH_REDIS"
    default_port = 6379
    package = "redis-server"

    def command(self, port: int, data_dir: str) -> list[str]:
        return [_program("redis-server"), "--bind", "127.0.0.1", "--port", str(port), "--dir", data_dir]


class ZooKeeperServer(PrivateServer):
    """Debian's ZooKeeper jar run as a standalone server (``ZooKeeperServerMain port dataDir``).

    Its transaction log is synced to disk before each write is acknowledged (ZooKeeper's default
    ``forceSync=yes``), like the SQL backends' commits. The admin HTTP server is off: it would take
    port 8080, which the permits service uses in the docs' examples.
    """

    env_var = "PERMITS_BENCH_ZOOKEEPER"
    default_port = 2181
    package = "zookeeper"

    def command(self, port: int, data_dir: str) -> list[str]:
        jar = _require("/usr/share/java/zookeeper.jar")  # its manifest names the other jars it needs
        return [
            _program("java"),
            "-Xmx512m",
            "-Dzookeeper.admin.enableServer=false",
            "-cp",
            jar,
            "org.apache.zookeeper.server.ZooKeeperServerMain",
            str(port),
            data_dir,
        ]


class EtcdServer(PrivateServer):
    """Debian's etcd as a one-member cluster. Every write is synced to its write-ahead log first."""

    env_var = "PERMITS_BENCH_ETCD"
    default_port = 2379
    package = "etcd-server"

    def command(self, port: int, data_dir: str) -> list[str]:
        peer = f"http://127.0.0.1:{free_port()}"
        return [
            _program("etcd"),
            "--name=permits-bench",
            f"--data-dir={data_dir}/data",
            f"--listen-client-urls=http://127.0.0.1:{port}",
            f"--advertise-client-urls=http://127.0.0.1:{port}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=permits-bench={peer}",
        ]

    def is_ready(self, port: int) -> bool:
        import httpx  # here, not at the top: the client processes import this module and never need it

        # Listening is not enough: a write fails until the member has elected itself leader.
        with contextlib.suppress(httpx.HTTPError):
            return bool(httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json().get("health") == "true")
        return False


class PgBouncerServer(PrivateServer):
    """Debian's PgBouncer in transaction mode in front of the benchmark's PostgreSQL (``target``, set by
    the system before ``ensure``), with its default pool of 20 server connections per database and user.
    Never an already running one: it must point at the benchmark's server. PgBouncer refuses to run as
    root, so a root benchmark runs it as the ``postgres`` user."""

    env_var = "PERMITS_BENCH_PGBOUNCER"
    default_port = 0
    package = "pgbouncer"
    #: host, port, user and password (None: none) of the PostgreSQL server to pool
    target: tuple[str, int, str, str | None] = ("127.0.0.1", 5432, "postgres", None)

    def is_ready(self, port: int) -> bool:
        return port != 0 and _accepts_connections("127.0.0.1", port)

    def run_as(self) -> str | None:
        return "postgres" if os.geteuid() == 0 else None

    def command(self, port: int, data_dir: str) -> list[str]:
        program = shutil.which("pgbouncer") or _require("/usr/sbin/pgbouncer")
        # The same configuration as tests/_pgbouncer.py's, written again: benchmarks/ does not import tests/.
        host, server_port, user, password = self.target
        secret = f" password={password}" if password else ""
        os.chmod(data_dir, 0o755)
        with open(os.path.join(data_dir, "users.txt"), "w") as f:
            f.write(f'"{user}" ""\n')
        ini = os.path.join(data_dir, "pgbouncer.ini")
        with open(ini, "w") as f:
            f.write(
                f"[databases]\n* = host={host} port={server_port} user={user}{secret}\n"
                f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
                f"auth_type = trust\nauth_file = {data_dir}/users.txt\npool_mode = transaction\n"
                "max_client_conn = 1000\n"
            )
        for name in ("users.txt", "pgbouncer.ini"):
            os.chmod(os.path.join(data_dir, name), 0o644)
        return [program, ini]


REDIS = RedisServer()
ZOOKEEPER = ZooKeeperServer()
ETCD = EtcdServer()
PGBOUNCER = PgBouncerServer()
