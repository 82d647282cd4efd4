"""A MariaDB Galera cluster of three nodes on this machine, loopback only, for the scale-out tests (issue 7).

Every node is Debian's ``mariadbd`` with the ``galera-4`` provider, on a data directory of its own under one
``tempfile.mkdtemp()`` directory, running as the ``mysql`` user, with its own ports::

    node  SQL   group communication (gcomm)  IST   SST (rsync)
    0     3311  4571                         4581  4591
    1     3312  4572                         4582  4592
    2     3313  4573                         4583  4593

The machine's own servers (3306, /etc/mysql) are never touched: each node reads only the ``my.cnf`` written
into its directory (``--defaults-file``), and so does the SST script it runs. Use::

    with GaleraCluster() as cluster:       # 11-18 s on 2 cores: node 0 bootstraps, 1 and 2 join by rsync SST
        cluster.url(2)                     # mysql://root@127.0.0.1:3313/test
        cluster.kill(1)                    # SIGKILL node 1 (and any SST helper it runs)
        cluster.restart(1)                 # --wsrep-recover, start again: it rejoins by IST, Synced on return
    # every process stopped, the directory removed

The settings the guarantees rest on are in ``_server_settings`` below, each with its reason.

What a cluster like this one needs, and why:
* the nodes run as ``mysql`` and their directories belong to ``mysql``: a node running as root makes rsync
  SST fail (the joiner's rsync daemon drops to ``nobody`` and cannot write the data directory: "rsync
  returned code 23", then "Will never receive state. Need to abort.").
* a ``my.cnf`` per node, given with ``--defaults-file``: the server hands that file on to the SST script
  (``wsrep_sst_rsync``), which reads the node's options again with ``my_print_defaults``, so that neither
  ever reads /etc/mysql.
* a node that was SIGKILLed has ``seqno: -1`` in grastate.dat and would ask for a whole SST; restart() first
  runs ``mariadbd --wsrep-recover`` (as systemd's galera_recovery does) so that it asks for IST instead.

Missing packages (mariadb-server, galera-4, rsync, iproute2 for ``ss``) are installed with apt-get when the
tests run as root on Debian, and are a clear error otherwise: never a skip.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import pymysql

from tests._private_db import _alive, _descendants

MARIADBD = Path("/usr/sbin/mariadbd")
INSTALL_DB = Path("/usr/bin/mariadb-install-db")
GALERA_PROVIDER = Path("/usr/lib/galera/libgalera_smm.so")
SST_SCRIPT = Path("/usr/bin/wsrep_sst_rsync")

#: what each node needs -> the Debian package that provides it. mariadb-server, not only mariadb-server-core:
#: the SST scripts are in mariadb-server. wsrep_sst_rsync finds out whether its rsync daemon listens with ss.
REQUIRED_PACKAGES = {
    str(MARIADBD): "mariadb-server",
    str(INSTALL_DB): "mariadb-server",
    str(SST_SCRIPT): "mariadb-server",
    str(GALERA_PROVIDER): "galera-4",
    "rsync": "rsync",
    "ss": "iproute2",
    "my_print_defaults": "mariadb-client-core",
}

#: one node's step of start() (a join: 5-9 s on a busy 2-core machine), with room for a much slower CI box
START_TIMEOUT = 120.0
#: how long a killed process may take to disappear from /proc
EXIT_TIMEOUT = 30.0
POLL_INTERVAL = 0.25
#: set to keep the cluster's directory (data and logs) after stop(), for a post-mortem
KEEP_ENV = "PERMITS_KEEP_TEST_CLUSTERS"


# ------------------------------------------------------------------------------------------------ packages


def ensure_debian_packages(required: dict[str, str], *, why: str) -> None:
    """Install the packages whose files or commands are missing (as root on Debian), or say what to install.

    ``required`` maps an absolute path or a command name to the package that provides it. A missing package
    is installed rather than skipped: the scale-out tests must run in CI (issue 7, section 4).
    """
    missing = sorted({package for thing, package in required.items() if not _present(thing)})
    if not missing:
        return
    if os.geteuid() != 0 or not Path("/etc/debian_version").exists():
        raise RuntimeError(f"{why} needs the packages {' '.join(missing)}: apt-get install {' '.join(missing)}")
    # wait for another apt-get (the CI image's, scripts/test's) rather than fail on the dpkg lock
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "-q", "-y"]
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in ([*apt, "update"], [*apt, "install", "--no-install-recommends", *missing]):
        done = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr}")
    still_missing = sorted({package for thing, package in required.items() if not _present(thing)})
    if still_missing:
        raise RuntimeError(f"{why}: installed {' '.join(missing)}, but {' '.join(still_missing)} still incomplete")


def _present(thing: str) -> bool:
    return Path(thing).exists() if thing.startswith("/") else shutil.which(thing) is not None


# --------------------------------------------------------------------------------------- ports, processes


def ensure_ports_free(ports: list[int]) -> None:
    """Fail at once, and clearly, when a port is taken (often: a cluster another run left behind)."""
    for port in ports:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as exc:
                raise RuntimeError(
                    f"127.0.0.1:{port} is in use ({exc.strerror}); is a test cluster of another run still up?"
                ) from None


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it at once, and wait until they are gone."""
    doomed = [pid, *_descendants(pid)]
    for victim in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    _wait_gone(doomed)


def kill_processes_using(directory: Path) -> None:
    """SIGKILL every process whose command line names ``directory``: a helper that a dead server left behind
    (an SST script, its rsync daemon, a backend) has no parent of ours any more but still names its files."""
    marker = str(directory).encode()
    doomed = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    doomed.append(int(entry.name))
            except OSError:
                continue
    for victim in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    _wait_gone(doomed)


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + EXIT_TIMEOUT
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def service_account(name: str) -> pwd.struct_passwd | None:
    """The account a server runs as: ``name`` when we are root (a server must not run as root), else none
    (the server runs as whoever runs the tests)."""
    return pwd.getpwnam(name) if os.geteuid() == 0 else None


def chown_tree(root: Path, account: pwd.struct_passwd | None) -> None:
    if account is None:
        return
    for path in [root, *root.rglob("*")]:
        os.chown(path, account.pw_uid, account.pw_gid, follow_symlinks=False)


# ---------------------------------------------------------------------------------------------------- nodes


@dataclass(frozen=True)
class NodePorts:
    sql: int
    gcomm: int  # group communication: the cluster's membership and the replication stream
    ist: int  # incremental state transfer: a rejoining node receives what it missed from the donor's gcache
    sst: int  # state snapshot transfer: the joiner's rsync daemon receives a whole data directory


class _Node:
    """One mariadbd: its directory, ports and process."""

    def __init__(self, index: int, directory: Path, ports: NodePorts) -> None:
        self.index = index
        self.dir = directory
        self.ports = ports
        self.data = directory / "data"
        self.socket = directory / "mysqld.sock"
        self.config = directory / "my.cnf"
        self.error_log = directory / "error.log"
        self.launch_log = directory / "launch.log"  # mariadbd's own stdout/stderr: what it says before logging
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def launch(self, *extra_arguments: str) -> None:
        assert not self.running, f"node {self.index} is already running"
        with self.launch_log.open("ab") as log:
            # a session of its own: a Ctrl-C in the test's terminal must not reach the cluster half-way
            self.process = subprocess.Popen(
                [str(MARIADBD), f"--defaults-file={self.config}", *extra_arguments],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.dir,
            )

    def recovered_position(self) -> str | None:
        """Where a crashed node's InnoDB stopped (``uuid:seqno``), so that it can ask its donor for just the rest.

        A clean shutdown writes the position to grastate.dat; a SIGKILL leaves ``seqno: -1`` there, and a node
        started like that asks for a whole SST. What systemd's galera_recovery does before every start, done
        here: ``mariadbd --wsrep-recover`` runs InnoDB's crash recovery, logs the position and exits.
        """
        if _grastate_seqno(self.data / "grastate.dat") != "-1":
            return None  # a clean position on disk, or never joined at all (then only SST can help)
        done = subprocess.run(
            [str(MARIADBD), f"--defaults-file={self.config}", "--wsrep-recover", "--disable-log-error"],
            capture_output=True,
            text=True,
            cwd=self.dir,
            check=False,
        )
        marker = "WSREP: Recovered position:"
        for line in done.stderr.splitlines():
            if marker in line:
                return line.split(marker, 1)[1].strip()
        with self.launch_log.open("a") as log:  # no position: the node falls back to SST, say why in its log
            log.write(f"--wsrep-recover found no position ({done.returncode}):\n{done.stderr[-2000:]}\n")
        return None

    def kill(self) -> None:
        if self.process is None:
            return
        kill_tree(self.process.pid)
        self.process.wait()
        kill_processes_using(self.dir)  # an SST helper that had already left mariadbd's tree

    def status(self) -> dict[str, str]:
        rows = self.query(
            "SHOW GLOBAL STATUS WHERE Variable_name IN "
            "('wsrep_local_state_comment', 'wsrep_cluster_size', 'wsrep_ready', 'wsrep_cluster_status')"
        )
        return {str(name).lower(): str(value) for name, value in rows}

    def query(self, statement: str) -> tuple[tuple[Any, ...], ...]:
        """Run one statement as root over the node's unix socket, which works before root may use TCP."""
        connection = pymysql.connect(
            unix_socket=str(self.socket), user="root", password="", connect_timeout=3, read_timeout=30, autocommit=True
        )
        try:
            with connection.cursor() as cursor:
                cursor.execute(statement)
                return tuple(cursor.fetchall())
        finally:
            connection.close()

    def log_tail(self, chars: int) -> str:
        parts = []
        for path in (self.launch_log, self.error_log):
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace").strip()
                if text:
                    parts.append(f"--- {path.name} (node {self.index})\n{text[-chars:]}")
        return "\n".join(parts) or f"(node {self.index} wrote no log)"


# -------------------------------------------------------------------------------------------------- cluster


class GaleraCluster:
    """Three Galera nodes on loopback; ``start()`` returns when all of them are Synced in one cluster."""

    def __init__(
        self, size: int = 3, *, sql_port: int = 3311, gcomm_port: int = 4571, ist_port: int = 4581, sst_port: int = 4591
    ) -> None:
        self.size = size
        self.ports = [NodePorts(sql_port + i, gcomm_port + i, ist_port + i, sst_port + i) for i in range(size)]
        # a name of its own: a node of some other cluster on these ports can never be let into this one
        self.name = f"permits_test_{uuid.uuid4().hex[:8]}"
        self.dir: Path | None = None
        self.nodes: list[_Node] = []
        #: seconds each step of start() took, for the test's report
        self.timings: dict[str, float] = {}

    # ---- life cycle

    def start(self) -> None:
        ensure_debian_packages(REQUIRED_PACKAGES, why="the Galera test cluster")
        ensure_ports_free([port for node in self.ports for port in (node.sql, node.gcomm, node.ist, node.sst)])
        account = service_account("mysql")
        self.dir = Path(tempfile.mkdtemp(prefix="permits-galera-"))
        atexit.register(self.stop)  # the test process ending without __exit__ must not leave nodes behind
        try:
            self._create_nodes(account)
            self._timed("install_db", self._install_system_tables)
            self._timed("bootstrap_node0", self._bootstrap)
            for node in self.nodes[1:]:
                self._timed(f"join_node{node.index}", lambda node=node: self._join(node))
            self.timings["total"] = round(sum(self.timings.values()), 1)
        except BaseException as exc:
            report = self.logs()
            self.stop()
            if isinstance(exc, Exception):
                raise RuntimeError(f"the Galera cluster did not come up: {exc}\n{report}") from exc
            raise

    def stop(self) -> None:
        """SIGKILL every node and every helper it runs, then remove the directory. Nothing survives: the data
        is thrown away, so there is nothing a clean shutdown would save."""
        atexit.unregister(self.stop)
        for node in self.nodes:
            node.kill()
        if self.dir is not None:
            kill_processes_using(self.dir)
            if not os.environ.get(KEEP_ENV):
                shutil.rmtree(self.dir, ignore_errors=True)
        self.nodes = []
        self.dir = None

    def __enter__(self) -> GaleraCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- what tests use

    def url(self, i: int) -> str:
        return f"mysql://root@127.0.0.1:{self.ports[i].sql}/test"

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``, as a crash of its machine would (any SST helper it runs dies with it)."""
        self.nodes[i].kill()

    def stop_node(self, i: int, timeout: float = 60.0) -> None:
        """Shut node ``i`` down cleanly (SIGTERM): it leaves the cluster and writes its position to disk."""
        node = self.nodes[i]
        if node.process is None or not node.running:
            return
        node.process.terminate()
        try:
            node.process.wait(timeout)
        except subprocess.TimeoutExpired:
            node.kill()

    def restart(self, i: int, timeout: float = START_TIMEOUT) -> None:
        """Start node ``i`` again after kill() or stop_node(); it rejoins the running nodes by IST when their
        gcache still holds what it missed (after a kill, once ``--wsrep-recover`` has found where it stopped),
        else by SST. Returns once it is Synced in a cluster of all running nodes."""
        node = self.nodes[i]
        if node.running:
            raise RuntimeError(f"node {i} is still running; kill it first")
        position = node.recovered_position()
        # never --wsrep-new-cluster: that would found a second cluster beside the first
        node.launch(*([f"--wsrep-start-position={position}"] if position else []))
        self.wait_synced(i, timeout)

    def wait_synced(self, i: int, timeout: float = START_TIMEOUT, size: int | None = None) -> None:
        """Wait until node ``i`` is Synced (serving, not donating or joining) in a cluster of ``size`` nodes:
        by default, every node this harness runs."""
        node = self.nodes[i]
        expected = size if size is not None else sum(n.running for n in self.nodes)
        deadline = time.monotonic() + timeout
        last_seen = "no answer yet"
        while True:
            if not node.running:
                code = node.process.returncode if node.process else None
                raise RuntimeError(f"node {i} exited ({code}) while waiting for Synced:\n{self.log_tail(i)}")
            try:
                status = node.status()
            except pymysql.Error as exc:  # not accepting connections yet (during SST it does not listen)
                last_seen = f"{type(exc).__name__}: {exc}"
            else:
                last_seen = str(status)
                synced = status.get("wsrep_local_state_comment") == "Synced"
                if synced and status.get("wsrep_ready") == "ON" and status.get("wsrep_cluster_size") == str(expected):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"node {i} not Synced in a cluster of {expected} within {timeout:.0f}s (last: {last_seen})\n"
                    f"{self.log_tail(i)}"
                )
            time.sleep(POLL_INTERVAL)

    def cluster_size(self, i: int) -> int:
        """How many nodes node ``i`` sees in its cluster (wsrep_cluster_size)."""
        return int(self.nodes[i].status()["wsrep_cluster_size"])

    def log_tail(self, i: int, chars: int = 4000) -> str:
        """The end of node ``i``'s logs (the error log carries the SST script's messages too)."""
        return self.nodes[i].log_tail(chars) if i < len(self.nodes) else f"(node {i} not created)"

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(self.log_tail(i, chars) for i in range(len(self.nodes)))

    def sessions(self) -> str:
        """What each node says of its sessions now, for a failure's message: its open InnoDB transactions, who
        waits on whose row lock, its sessions and what they run, and its replication state (a node paused by
        flow control, or applying a backlog, holds its rows locked meanwhile)."""
        reports = []
        for i, node in enumerate(self.nodes):
            if not node.running:
                reports.append(f"node {i}: not running")
                continue
            parts = [f"node {i}:"]
            for title, statement in (
                (
                    "transactions",
                    "SELECT trx_id, trx_state, trx_started, trx_mysql_thread_id, trx_rows_locked, trx_query"
                    " FROM information_schema.innodb_trx",
                ),
                ("lock waits", "SELECT * FROM information_schema.innodb_lock_waits"),
                (
                    "sessions",
                    "SELECT id, user, command, time, state, LEFT(info, 200) FROM information_schema.processlist"
                    " WHERE id <> CONNECTION_ID() AND (command <> 'Sleep' OR time > 2)",
                ),
                (
                    "replication",
                    "SHOW STATUS WHERE variable_name IN ('wsrep_local_state_comment', 'wsrep_flow_control_paused',"
                    " 'wsrep_local_recv_queue', 'wsrep_local_send_queue', 'wsrep_local_bf_aborts',"
                    " 'wsrep_local_cert_failures')",
                ),
            ):
                try:
                    rows = node.query(statement)
                except pymysql.MySQLError as exc:
                    parts.append(f"  {title}: {exc}")
                    continue
                parts.append(f"  {title}:" + "".join(f"\n    {row}" for row in rows))
            reports.append("\n".join(parts))
        return "\n".join(reports)

    # ---- start(), step by step

    def _timed(self, step: str, action: Any) -> None:
        began = time.monotonic()
        action()
        self.timings[step] = round(time.monotonic() - began, 1)

    def _create_nodes(self, account: pwd.struct_passwd | None) -> None:
        assert self.dir is not None
        addresses = ",".join(f"127.0.0.1:{ports.gcomm}" for ports in self.ports)
        for i, ports in enumerate(self.ports):
            node = _Node(i, self.dir / f"node{i}", ports)
            (node.dir / "tmp").mkdir(parents=True)
            node.data.mkdir()
            settings = _server_settings(node, cluster_name=self.name, addresses=addresses, account=account)
            node.config.write_text(_render_config(settings))
            self.nodes.append(node)
        chown_tree(self.dir, account)  # the servers and the rsync daemons they start write here as mysql

    def _install_system_tables(self) -> None:
        """The system tables on node 0 only: the joiners receive node 0's data directory by SST."""
        node = self.nodes[0]
        # --defaults-file must come first. normal root authentication: root@localhost with an empty password,
        # so that the harness logs in over the socket whoever runs the tests (unix_socket would need OS root)
        done = subprocess.run(
            [
                str(INSTALL_DB),
                f"--defaults-file={node.config}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            capture_output=True,
            text=True,
            cwd=node.dir,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr}")

    def _bootstrap(self) -> None:
        """Node 0 founds the cluster (a Primary Component of one), then gets the database and TCP root."""
        node = self.nodes[0]
        node.launch("--wsrep-new-cluster")
        self.wait_synced(0, size=1)
        # DDL and account changes replicate to every node (total order isolation); the joiners get them by SST
        for statement in (
            "CREATE USER IF NOT EXISTS 'root'@'127.0.0.1'",
            # whatever mariadb-install-db made of root@127.0.0.1: an empty password, as the tests' URLs say
            "ALTER USER 'root'@'127.0.0.1' IDENTIFIED BY ''",
            "GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION",
            "CREATE DATABASE IF NOT EXISTS test",
        ):
            node.query(statement)

    def _join(self, node: _Node) -> None:
        node.launch()
        self.wait_synced(node.index, size=node.index + 1)


def _server_settings(
    node: _Node, *, cluster_name: str, addresses: str, account: pwd.struct_passwd | None
) -> dict[str, str | None]:
    """The ``[mysqld]`` options of one node. ``None``: a flag without a value."""
    ports = node.ports
    provider_options = ";".join(
        [
            f"gmcast.listen_addr=tcp://127.0.0.1:{ports.gcomm}",
            f"ist.recv_addr=127.0.0.1:{ports.ist}",
            f"base_port={ports.gcomm}",
            # the donor keeps this much of the replication stream, so a node that was down for a while
            # rejoins by IST (only what it missed) rather than SST (a whole copy); preallocated on disk
            "gcache.size=64M",
            # failure detection keeps Galera's defaults (a dead peer is evicted after evs.suspect_timeout,
            # PT5S; commits on the others wait that long): faster would risk false evictions on 2 cores
        ]
    )
    settings: dict[str, str | None] = {
        # ---- where it lives: all of it under the cluster's temp dir, loopback only
        "datadir": str(node.data),
        "socket": str(node.socket),
        "pid-file": str(node.dir / "mysqld.pid"),
        "tmpdir": str(node.dir / "tmp"),
        "log-error": str(node.error_log),
        "port": str(ports.sql),
        "bind-address": "127.0.0.1",
        "skip-name-resolve": None,  # root@127.0.0.1 matches by address; no DNS in the login path
        # ---- small, so that three nodes and the machine's own servers fit
        "innodb_buffer_pool_size": "64M",
        "innodb_log_file_size": "48M",
        "performance_schema": "OFF",
        "max_connections": "200",
        # ---- what Galera requires to replicate correctly
        "binlog_format": "ROW",  # writesets are row images; Galera refuses statement-based replication
        "default_storage_engine": "InnoDB",  # only InnoDB is replicated; a MyISAM table would silently diverge
        "innodb_autoinc_lock_mode": "2",  # interleaved: the table-level AUTO-INC lock would deadlock appliers
        "skip-log-bin": None,  # Galera needs no binary log of its own; binlog_format still sets the row format
        # ---- what permits' guarantees rest on
        # Each node's commit is on its own disk before it is acknowledged. While a majority is up, nothing
        # acknowledged is lost anyway (every node received the writeset before the commit returned); 1 is what
        # keeps it when every node goes down at once. A SIGKILL alone would lose nothing at 2 either.
        "innodb_flush_log_at_trx_commit": "1",
        # 1 = a read (SELECT, and so the acquire's SELECT ... FOR UPDATE) waits until this node has applied
        # every writeset the cluster ordered before it: causal reads on any node. Over-grant safety does not
        # need it (certification aborts the stale writer with 1213), but without it a retry after 1213 may
        # read the same stale state, and a test that writes on one node and reads on another would flake.
        "wsrep_sync_wait": "1",
        # 0 = a single autocommit statement that loses certification fails with 1213 instead of being
        # re-run quietly by the server (default 1). The tests then see every certification failure, and
        # prove that permits itself retries them. Multi-statement transactions are never retried by the server.
        "wsrep_retry_autocommit": "0",
        # ---- Galera wiring
        "wsrep_on": "ON",
        "wsrep_provider": str(GALERA_PROVIDER),
        "wsrep_cluster_name": cluster_name,
        "wsrep_cluster_address": f"gcomm://{addresses}",
        "wsrep_node_name": f"node{node.index}",
        "wsrep_node_address": f"127.0.0.1:{ports.gcomm}",
        "wsrep_node_incoming_address": f"127.0.0.1:{ports.sql}",
        "wsrep_provider_options": f'"{provider_options}"',
        "wsrep_slave_threads": "2",
        # rsync: needs nothing but rsync, and copies a small data directory in a second or two
        "wsrep_sst_method": "rsync",
        "wsrep_sst_receive_address": f"127.0.0.1:{ports.sst}",
    }
    if account is not None:
        # mariadbd starts as root and drops to mysql before it opens anything; so do its SST scripts
        settings = {"user": account.pw_name, **settings}
    return settings


def _grastate_seqno(path: Path) -> str | None:
    """The ``seqno:`` of a node's grastate.dat: its last committed writeset after a clean shutdown, -1 while
    it runs or after a crash; None when there is no such file (the node never joined a cluster)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    values = [line.split(":", 1)[1].strip() for line in lines if line.startswith("seqno:")]
    return values[0] if values else None


def _render_config(settings: dict[str, str | None]) -> str:
    lines = ["# written by tests/_galera.py; read by mariadbd and by wsrep_sst_rsync (my_print_defaults)", "[mysqld]"]
    lines += [name if value is None else f"{name} = {value}" for name, value in settings.items()]
    return "\n".join(lines) + "\n"
