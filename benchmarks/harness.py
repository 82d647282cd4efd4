"""Multi-process load generator for SQL-backed counting semaphores.

System interface
================

A *system* is any object (or module) with these two callables::

    setup(backend_url: str, scenario: Scenario) -> None
        Runs once in the parent before the clients start. Must leave the
        backend in a clean, known state: drop and recreate its tables, create
        every semaphore of ``scenario.all_semaphores()`` with
        ``scenario.capacity`` permits.

    make_client(backend_url: str, scenario: Scenario, client_index: int) -> Client
        Runs inside each child process; opens the client's connection(s).
        The client uses the semaphores ``scenario.semaphores_for(client_index)``.

A *client* has::

    cycle() -> bool   one acquire followed by one release. True if the acquire
                      was granted (and then released), False if it was refused
                      for lack of room (nothing to release). Raising counts as
                      an error; the harness keeps the client looping.
    close() -> None

Optional hooks, used when present:

    system.load_history(backend_url, scenario, rows) -> None
        Pre-load ``rows`` old, already released rows (``--history``). The
        harness calls it after ``setup`` and times it.
    system.verify(backend_url, scenario) -> list[str]
        After the run: describe any leftover inconsistency (e.g. a permit
        still held although every client released). Empty list = fine.
    client.stats() -> Mapping[str, int]
        Counters (e.g. deadlock retries), summed over clients in the result.
    system.sample() -> Mapping[str, float]
        Called in the parent every SAMPLE_INTERVAL seconds while the clients
        run (e.g. a service's busy database connections); the result keeps the
        mean and the maximum of each figure.
    system.teardown(backend_url, scenario) -> None
        After the run and ``verify``: stop what ``setup`` started.
    system.server_pids() -> Sequence[int]
        The processes of a server the system started (a service in front of
        the backend): their CPU time is counted apart (``RunResult.cpu``).

``backend_url`` is driver-less: ``sqlite:////abs/path.db``,
``mysql://user:pw@host:port/db`` or ``postgresql://user@host:port/db``.
``sqlalchemy_url()`` maps it to a SQLAlchemy URL with the installed drivers.

Children are forked from a fork server (spawned where there is none), so a system passed as an object
must be picklable (an instance of a module-level class); a module, or a
``"module:attr"`` string, is re-imported in each child instead. ``run()`` and
the CLI also accept the short names in ``BUILTIN_SYSTEMS``.

A new system lives in a module beside this file (benchmarks/ is on sys.path
when the harness runs) and is named on the command line as ``module:attr``,
e.g. ``--system systems:PERMITS``, or added to ``BUILTIN_SYSTEMS``.

Usage::

    python benchmarks/harness.py --system floor --backend mariadb \\
        --scenario hot --clients 1,4,16 --seconds 3
    python benchmarks/harness.py --system seed --backend postgresql \\
        --clients 1 --history 1000000 --json results.jsonl

or from Python: ``run(system, backend_url, "hot", clients=4, seconds=3)``,
which returns a ``RunResult``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib
import json
import math
import multiprocessing
import multiprocessing.queues
import os
import platform
import queue
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback
import types
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.synchronize import Event
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

# --------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------

SCENARIO_NAMES = ("hot", "spread")
DEFAULT_CAPACITY = 10


@dataclass(frozen=True)
class Scenario:
    """Which semaphores each client uses.

    ``hot``: every client shares one semaphore (maximum contention on one row).
    ``spread``: each client has its own semaphore (no logical contention; what
    is left is the cost of the engine itself: log flushes, index maintenance).

    ``per_acquire``: how many semaphores one acquire takes together, one permit
    of each (all or nothing). With more than one, ``hot`` clients share that
    many semaphores and ``spread`` clients each have that many of their own.
    """

    name: str
    clients: int
    capacity: int = DEFAULT_CAPACITY
    per_acquire: int = 1

    def __post_init__(self) -> None:
        if self.name not in SCENARIO_NAMES:
            raise ValueError(f"unknown scenario {self.name!r}; expected one of {SCENARIO_NAMES}")
        if self.clients < 1 or self.capacity < 1 or self.per_acquire < 1:
            raise ValueError("clients, capacity and per_acquire must be >= 1")

    @property
    def label(self) -> str:
        """``hot``, ``spread``; ``hotx3`` for three semaphores per acquire."""
        return self.name if self.per_acquire == 1 else f"{self.name}x{self.per_acquire}"

    def semaphores_for(self, client_index: int) -> tuple[str, ...]:
        """Names of the semaphores client ``client_index`` acquires together."""
        base = "hot" if self.name == "hot" else f"spread-{client_index:04d}"
        if self.per_acquire == 1:
            return (base,)
        return tuple(f"{base}-{k}" for k in range(self.per_acquire))

    def all_semaphores(self) -> tuple[str, ...]:
        """Every semaphore ``setup`` must create, without duplicates, in order."""
        names = (n for i in range(self.clients) for n in self.semaphores_for(i))
        return tuple(dict.fromkeys(names))


# --------------------------------------------------------------------------
# System interface (see the module docstring)
# --------------------------------------------------------------------------


@runtime_checkable
class Client(Protocol):
    def cycle(self) -> bool: ...

    def close(self) -> None: ...


@runtime_checkable
class System(Protocol):
    def setup(self, backend_url: str, scenario: Scenario) -> None: ...

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> Client: ...


# Short names understood by run() and the CLI; anything else is "module:attr".
# The library's own system can be registered here once it exists.
BUILTIN_SYSTEMS: dict[str, str] = {
    "floor": "baselines:FLOOR",
    "seed": "baselines:SEED",
    "lease-floor": "baselines:LEASE_FLOOR",
}


def resolve_system(ref: str | System) -> System:
    """Turn a short name, ``"module:attr"`` or ``"module"`` into a system."""
    if not isinstance(ref, str):
        return ref
    spec = BUILTIN_SYSTEMS.get(ref, ref)
    module_name, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    if attr:
        obj = getattr(obj, attr)
    if not isinstance(obj, System):
        raise TypeError(f"{spec!r} has no setup()/make_client(); not a benchmark system")
    return obj


def _system_label(ref: str | System) -> str:
    if isinstance(ref, str):
        return ref
    if isinstance(ref, types.ModuleType):
        return ref.__name__
    return str(getattr(ref, "name", type(ref).__name__))


def _picklable_ref(ref: str | System) -> str | System:
    # Modules cannot be pickled to a spawned child; their name can.
    if isinstance(ref, types.ModuleType):
        return ref.__name__
    return ref


# --------------------------------------------------------------------------
# Backends: URLs, raw DB-API connections, database creation
# --------------------------------------------------------------------------

BACKENDS = ("sqlite", "mariadb", "postgresql")

# How long a client waits for a lock before giving up. The seed design uses
# 5 s on MariaDB; the same value is used for every backend (SQLite's busy
# timeout, PostgreSQL's lock_timeout) so the backends are comparable.
LOCK_WAIT_SECONDS = 5


def default_url(backend: str) -> str:
    """The benchmark URL of ``backend``; each can be overridden by environment."""
    if backend == "sqlite":
        path = os.path.join(tempfile.gettempdir(), "permits-bench", "bench.db")
        return os.environ.get("PERMITS_BENCH_SQLITE_URL", f"sqlite:///{path}")
    if backend == "mariadb":
        return os.environ.get("PERMITS_BENCH_MYSQL_URL", "mysql://root@127.0.0.1:3306/permits_bench")
    if backend == "postgresql":
        return os.environ.get("PERMITS_BENCH_POSTGRESQL_URL", "postgresql://postgres@127.0.0.1:5432/permits_bench")
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def _scheme(url: str) -> str:
    # "mysql+pymysql://..." -> "mysql": SQLAlchemy-style URLs are accepted too.
    return url.split(":", 1)[0].split("+", 1)[0].lower()


def backend_of(url: str) -> str:
    """``"sqlite"``, ``"mariadb"`` or ``"postgresql"`` for a backend URL."""
    scheme = _scheme(url)
    if scheme == "sqlite":
        return "sqlite"
    if scheme in ("mysql", "mariadb"):
        return "mariadb"
    if scheme in ("postgresql", "postgres"):
        return "postgresql"
    raise ValueError(f"unsupported backend URL {url!r}")


def sqlalchemy_url(url: str) -> str:
    """The SQLAlchemy URL (with the drivers installed in the venv) for ``url``."""
    rest = url.split("://", 1)[1]
    driver = {
        "sqlite": "sqlite",
        "mariadb": "mysql+pymysql",
        "postgresql": "postgresql+psycopg",
    }[backend_of(url)]
    return f"{driver}://{rest}"


def sqlite_path(url: str) -> str:
    # SQLAlchemy convention: sqlite:///relative.db, sqlite:////absolute.db.
    if "://" not in url:
        raise ValueError(f"bad sqlite URL {url!r}")
    return url.split("://", 1)[1][1:].split("?", 1)[0]


def _mysql_params(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    return {
        "host": parts.hostname or "127.0.0.1",
        "port": parts.port or 3306,
        "user": unquote(parts.username or "root"),
        "password": unquote(parts.password or ""),
        "database": parts.path.lstrip("/") or None,
    }


def _libpq_url(url: str) -> str:
    # psycopg understands postgresql:// URIs but not "postgresql+psycopg://".
    return "postgresql://" + url.split("://", 1)[1]


def connect(url: str, *, database: bool = True, client_flag: int = 0) -> Any:
    """A raw DB-API connection in autocommit mode.

    Autocommit everywhere so that each statement outside an explicit BEGIN is
    its own transaction, which is what both baselines need; transactions are
    opened explicitly with BEGIN / BEGIN IMMEDIATE. ``database=False`` connects
    to the server without selecting the bench database (to create it).
    ``client_flag``: PyMySQL's capability flags (MULTI_STATEMENTS, say); ignored elsewhere.
    """
    backend = backend_of(url)
    if backend == "sqlite":
        # isolation_level=None: no implicit BEGIN from the sqlite3 module.
        # timeout is SQLite's busy timeout, the analogue of a lock wait timeout.
        conn = sqlite3.connect(sqlite_path(url), timeout=LOCK_WAIT_SECONDS, isolation_level=None)
        # WAL lets readers run beside the single writer. synchronous=FULL makes
        # every commit durable, like the servers' defaults
        # (innodb_flush_log_at_trx_commit=1, synchronous_commit=on), so the
        # three backends pay for the same guarantee.
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn
    if backend == "mariadb":
        import pymysql

        params = _mysql_params(url)
        if not database:
            params["database"] = None
        return pymysql.connect(
            **params, autocommit=True, charset="utf8mb4", connect_timeout=10, client_flag=client_flag
        )
    import psycopg

    conninfo = _libpq_url(url)
    if not database:
        conninfo = psycopg.conninfo.make_conninfo(conninfo, dbname="postgres")
    return psycopg.connect(conninfo, autocommit=True, connect_timeout=10)


def ensure_database(url: str) -> None:
    """Create the bench database (or SQLite file's directory) if missing."""
    backend = backend_of(url)
    if backend == "sqlite":
        os.makedirs(os.path.dirname(os.path.abspath(sqlite_path(url))), exist_ok=True)
        return
    if backend == "mariadb":
        name = _mysql_params(url)["database"]
        if not name:
            raise ValueError(f"no database in {url!r}")
        conn = connect(url, database=False)
        try:
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE IF NOT EXISTS `{name}`")
        finally:
            conn.close()
        return
    import psycopg
    from psycopg import sql

    name = psycopg.conninfo.conninfo_to_dict(_libpq_url(url)).get("dbname")
    if not name:
        raise ValueError(f"no database in {url!r}")
    conn = connect(url, database=False)
    try:
        row = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if row is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(str(name))))
    finally:
        conn.close()


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a server a system starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(process: subprocess.Popen[Any] | None, grace: float = 30) -> None:
    """Stop a server a system started: SIGTERM, then SIGKILL if it is still there after ``grace`` s."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def settle_statistics(url: str) -> None:
    """After a bulk load: vacuum and analyse now, as a real table's autovacuum long since has, so that
    autovacuum does not do it during the timed run (on PostgreSQL it cost 10-40% of a run's cycles)."""
    conn = connect(url)
    try:
        cur = conn.cursor()
        backend = backend_of(url)
        if backend == "postgresql":
            cur.execute("VACUUM ANALYZE")
        elif backend == "sqlite":
            cur.execute("ANALYZE")
        else:  # MariaDB: fresh statistics for every table of the benchmark's database
            cur.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE()")
            for (table,) in cur.fetchall():
                cur.execute(f"ANALYZE TABLE `{table}`")
                cur.fetchall()
    finally:
        conn.close()


def ensure_max_connections(url: str, needed: int) -> None:
    """Make sure a PostgreSQL server accepts ``needed`` connections. Debian's default is 100; a local
    cluster we may administer (root, Debian's pg_ctlcluster) is raised and restarted, anything else is
    only checked."""
    conn = connect(url)
    cur = conn.cursor()
    cur.execute("SHOW max_connections")
    have = int(cur.fetchone()[0])
    if have >= needed:
        conn.close()
        return
    parts = urlsplit(url)
    local = parts.hostname in ("127.0.0.1", "localhost", "::1")
    if not (local and os.geteuid() == 0 and shutil.which("pg_ctlcluster") and shutil.which("pg_lsclusters")):
        conn.close()
        raise SystemExit(f"PostgreSQL at {url} accepts {have} connections; this run needs {needed}")
    print(f"raising PostgreSQL's max_connections from {have} to {needed} (restarts the server)", file=sys.stderr)
    conn.autocommit = True
    cur.execute(f"ALTER SYSTEM SET max_connections = {int(needed)}")
    conn.close()
    port = str(parts.port or 5432)
    clusters = subprocess.run(["pg_lsclusters", "-h"], capture_output=True, text=True, check=True).stdout
    version, name = next(line.split()[:2] for line in clusters.splitlines() if line.split()[2] == port)
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, name, "restart"], check=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            connect(url).close()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def server_version(url: str) -> str:
    """Product and version of the server behind ``url`` (SQLite: the library)."""
    backend = backend_of(url)
    if backend == "sqlite":
        return f"SQLite {sqlite3.sqlite_version}"
    conn = connect(url, database=False)
    try:
        cur = conn.cursor()
        if backend == "mariadb":
            cur.execute("SELECT VERSION()")
            return f"MariaDB {cur.fetchone()[0]}"
        cur.execute("SHOW server_version")
        return f"PostgreSQL {cur.fetchone()[0]}"
    finally:
        conn.close()


def describe_machine(backend_urls: Iterable[str] | None = None) -> str:
    """One paragraph describing where the figures were measured."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram = "unknown RAM"
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    ram = f"{int(line.split()[1]) / 1024**2:.1f} GiB RAM"
                    break
    except OSError:
        pass
    os_name = platform.system()
    try:
        with open("/etc/os-release", encoding="utf-8") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    os_name = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 0
    urls = list(backend_urls) if backend_urls is not None else [default_url(b) for b in BACKENDS]
    versions = []
    for url in urls:
        try:
            versions.append(server_version(url))
        except Exception as exc:  # a server that is down should not stop the report
            versions.append(f"{backend_of(url)} unavailable ({type(exc).__name__})")
    return (
        f"{cpu}, {cores} cores, {ram}; {os_name} (Linux {platform.release()}); "
        f"Python {platform.python_version()}; " + ", ".join(versions)
    )


# --------------------------------------------------------------------------
# Child process
# --------------------------------------------------------------------------

# A client that fails this many cycles in a row is broken (server gone,
# schema dropped); stop it rather than spin for the rest of the run.
MAX_CONSECUTIVE_ERRORS = 50
# Cycle error messages kept per client; the rest are only counted.
MAX_ERROR_SAMPLES = 3


@dataclass
class ClientReport:
    """What one child sends back. Only builtins inside, so it pickles cheaply."""

    index: int
    granted: int
    refused: int
    errors: int
    error_samples: list[str]
    elapsed_s: float
    latencies: bytes  # array("d") of per-cycle seconds, granted and refused cycles
    stats: dict[str, int] = field(default_factory=dict)
    cpu_s: float = 0.0  # the process's CPU time (all its threads) over the counted seconds


def _child_main(
    system_ref: str | System,
    backend_url: str,
    scenario: Scenario,
    index: int,
    seconds: float,
    results: multiprocessing.queues.Queue[tuple[str, int, Any]],
    start: Event,
    abort: Event,
    start_timeout: float,
    warmup: float = 0.0,
    environment: dict[str, str] | None = None,
) -> None:
    """Entry point of a client process: connect, report ready, wait, loop. ``environment``: the parent's,
    as it is now (a fork server's children inherit the server's, from when it started; a system's setup
    may have set a variable since, such as where its private server listens)."""
    if environment is not None:
        os.environ.clear()
        os.environ.update(environment)
    try:
        client = resolve_system(system_ref).make_client(backend_url, scenario, index)
    except BaseException:
        results.put(("error", index, f"client {index} failed to start:\n{traceback.format_exc()}"))
        return
    try:
        results.put(("ready", index, None))
        # The start event is the barrier: the parent sets it once every client
        # has connected, so connection set-up is never timed.
        if not start.wait(start_timeout) or abort.is_set():
            return
        results.put(("result", index, _loop(client, index, seconds, warmup)))
    except BaseException:
        results.put(("error", index, f"client {index} crashed:\n{traceback.format_exc()}"))
    finally:
        # The figures are already sent; a failing close changes nothing.
        with contextlib.suppress(Exception):
            client.close()


def _loop(client: Client, index: int, seconds: float, warmup: float = 0.0) -> ClientReport:
    latencies = array("d")
    granted = refused = errors = consecutive_errors = 0
    samples: list[str] = []
    perf = time.perf_counter
    cycle = client.cycle
    # Warm-up cycles are not counted: a system reaches its steady state first (pools filled, waiters
    # paced to the contention they met), as it would long since have in production.
    warm_until = perf() + warmup
    while perf() < warm_until:
        with contextlib.suppress(Exception):
            cycle()
    cpu_began = time.process_time()
    began = now = perf()
    deadline = began + seconds
    while now < deadline:
        try:
            ok = cycle()
        except Exception as exc:
            errors += 1
            consecutive_errors += 1
            if len(samples) < MAX_ERROR_SAMPLES:
                samples.append(f"client {index}: {type(exc).__name__}: {exc}")
            now = perf()
            if consecutive_errors >= MAX_CONSECUTIVE_ERRORS:
                samples.append(f"client {index}: stopped after {consecutive_errors} errors in a row")
                break
            continue
        end = perf()
        latencies.append(end - now)
        if ok:
            granted += 1
        else:
            refused += 1
        consecutive_errors = 0
        now = end
    stats_hook = getattr(client, "stats", None)
    stats = {str(k): int(v) for k, v in stats_hook().items()} if stats_hook else {}
    cpu_s = time.process_time() - cpu_began
    return ClientReport(index, granted, refused, errors, samples, now - began, latencies.tobytes(), stats, cpu_s)


# --------------------------------------------------------------------------
# Parent: run and collect
# --------------------------------------------------------------------------


@dataclass
class RunResult:
    system: str
    backend: str
    scenario: str
    clients: int
    seconds: float
    granted: int = 0
    refused: int = 0
    cycles_per_s: float = 0.0  # granted cycles only
    p50_ms: float | None = None  # over granted and refused cycles
    p99_ms: float | None = None
    max_ms: float | None = None  # shows starvation that p99 averages away
    per_client_granted: list[int] = field(default_factory=list)
    error_count: int = 0  # failed cycles plus clients that crashed or hung
    errors: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    setup_s: float = 0.0
    history_rows: int = 0
    history_load_s: float | None = None
    # 1-minute load average when the run started: on a shared 2-core machine
    # a high value flags figures skewed by some other process.
    load_before: float = 0.0
    # system.sample() figures over the run: {name: {"mean": ..., "max": ...}}
    samples: dict[str, dict[str, float]] = field(default_factory=dict)
    # CPU time spent over the counted seconds, in cores (CPU seconds per second), by part: "clients",
    # "server" (system.server_pids()), "stores" (every process of the database and peer servers on
    # this machine), "all" (the whole machine, idle excluded). Empty where it cannot be read.
    cpu: dict[str, float] = field(default_factory=dict)

    def cpu_ms_per_cycle(self, part: str) -> float | None:
        """CPU milliseconds ``part`` spent per granted cycle, or None when not measured."""
        if part not in self.cpu or self.cycles_per_s <= 0:
            return None
        return self.cpu[part] / self.cycles_per_s * 1000

    @property
    def fairness(self) -> float:
        return jain_index(self.per_client_granted)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "fairness": self.fairness}


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index: 1.0 when all equal, 1/n when one takes all.

    Returns 0.0 when nothing was granted at all (fairness is undefined then).
    """
    total = sum(values)
    squares = sum(v * v for v in values)
    if not values or squares == 0:
        return 0.0
    return total * total / (len(values) * squares)


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty sequence."""
    rank = math.ceil(len(sorted_values) * pct / 100)
    return sorted_values[min(max(rank, 1), len(sorted_values)) - 1]


LOCK_FILE = os.path.join(tempfile.gettempdir(), "permits-bench.lock")


@contextlib.contextmanager
def exclusive_machine() -> Iterator[None]:
    """Hold the machine-wide benchmark lock.

    Two benchmarks at once share the cores and the bench databases: each
    skews the other's figures, and one's setup() drops the other's tables
    mid-run. So runs queue on an flock, held for one run at a time.
    """
    with open(LOCK_FILE, "a", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another benchmark run to finish ({LOCK_FILE})...", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run(
    system: str | System,
    backend_url: str,
    scenario: str | Scenario,
    clients: int,
    seconds: float,
    *,
    history: int = 0,
    start_timeout: float = 120.0,
    grace: float = 30.0,
    warmup: float = 0.0,
) -> RunResult:
    """Set ``system`` up on ``backend_url`` and drive it with ``clients`` processes.

    Each child loops ``cycle()`` for ``seconds`` once all children have
    connected, after ``warmup`` seconds of cycles that are not counted. A
    child that fails to start, crashes, dies or is still busy ``grace``
    seconds after its time is up is reported in ``errors`` (and
    terminated); the parent never waits on it forever. Runs are serialised
    machine-wide (see ``exclusive_machine``).
    """
    with exclusive_machine():
        return _run(system, backend_url, scenario, clients, seconds, history, start_timeout, grace, warmup)


def _run(
    system: str | System,
    backend_url: str,
    scenario: str | Scenario,
    clients: int,
    seconds: float,
    history: int,
    start_timeout: float,
    grace: float,
    warmup: float = 0.0,
) -> RunResult:
    scenario = Scenario(scenario, clients) if isinstance(scenario, str) else replace(scenario, clients=clients)
    sys_obj = resolve_system(system)
    result = RunResult(_system_label(system), backend_of(backend_url), scenario.label, clients, seconds)

    with contextlib.suppress(OSError):  # no load average off Unix
        result.load_before = os.getloadavg()[0]
    ensure_database(backend_url)
    t0 = time.perf_counter()
    sys_obj.setup(backend_url, scenario)
    result.setup_s = time.perf_counter() - t0
    if history:
        loader = getattr(sys_obj, "load_history", None)
        if loader is None:
            raise TypeError(f"system {result.system!r} has no load_history(); cannot use history")
        t0 = time.perf_counter()
        loader(backend_url, scenario, history)
        settle_statistics(backend_url)
        result.history_rows = history
        result.history_load_s = time.perf_counter() - t0

    ctx = _client_context()
    results: multiprocessing.queues.Queue[tuple[str, int, Any]] = ctx.Queue()
    start, abort = ctx.Event(), ctx.Event()
    ref = _picklable_ref(system)
    procs = [
        ctx.Process(
            target=_child_main,
            args=(
                ref,
                backend_url,
                scenario,
                i,
                seconds,
                results,
                start,
                abort,
                start_timeout,
                warmup,
                dict(os.environ),
            ),
            name=f"bench-client-{i}",
            daemon=True,  # never outlive the parent, even if it is killed
        )
        for i in range(clients)
    ]
    reports: dict[int, ClientReport] = {}
    failures: dict[int, str] = {}
    try:
        for p in procs:
            p.start()
        ready: dict[int, Any] = {}
        _collect(procs, results, "ready", ready, failures, time.perf_counter() + start_timeout)
        if failures or len(ready) < clients:
            abort.set()
        start.set()
        if not abort.is_set():
            server_pids = getattr(sys_obj, "server_pids", None)
            counted = _counting_cpu(result, list(server_pids()) if server_pids else [], warmup, seconds)
            with _sampling(sys_obj, result), counted:
                _collect(procs, results, "result", reports, failures, time.perf_counter() + warmup + seconds + grace)
    finally:
        abort.set()
        start.set()
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()

    _summarise(result, reports, failures)
    verify = getattr(sys_obj, "verify", None)
    try:
        if verify is not None and not failures:
            for problem in verify(backend_url, scenario):
                result.errors.append(f"verify: {problem}")
                result.error_count += 1
    finally:
        teardown = getattr(sys_obj, "teardown", None)
        if teardown is not None:
            teardown(backend_url, scenario)
    return result


#: What the fork server imports once, so that each client starts without importing them again (a
#: permits client imports SQLAlchemy, its drivers and the library: about a second of CPU per process).
CLIENT_PRELOAD = ("harness", "baselines", "systems", "peers", "service_system", "lean_http", "permits")


def _client_context() -> multiprocessing.context.BaseContext:
    """Clients are forked from a fork server that has imported ``CLIENT_PRELOAD``: a fresh process like a
    spawned one (no connection, thread or lock of this process is inherited), minus the imports. Where
    there is no fork server (not Unix) they are spawned."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(CLIENT_PRELOAD))  # a module that fails to import is skipped
    return ctx


#: Processes counted as the stores' (``RunResult.cpu["stores"]``), by name: the databases', and the peers'
#: own servers (ZooKeeper runs in a JVM).
STORE_PROCESSES = frozenset({"postgres", "mariadbd", "mysqld", "redis-server", "etcd", "java"})


def _cpu_snapshot(servers: Sequence[int]) -> dict[str, dict[int, float]]:
    """CPU seconds used so far by each process of the servers and of the stores, and by the machine (as
    process 0 of its own part)."""
    import psutil

    def used(pids: Iterable[int]) -> dict[int, float]:
        seconds = {}
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(pid).cpu_times()
                seconds[pid] = times.user + times.system
        return seconds

    stores = [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in STORE_PROCESSES]
    return {"server": used(servers), "stores": used(stores), "all": {0: machine_busy_seconds()}}


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy so far, on every core (all but idle and I/O wait)."""
    import psutil

    machine = psutil.cpu_times()
    return sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)


def _cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """The CPU seconds used between two readings by the processes of one part: a process that has gone by
    the second one (a database backend whose client closed) is left out; one that came after the first is
    counted from its start."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


@contextlib.contextmanager
def _counting_cpu(result: RunResult, servers: Sequence[int], warmup: float, seconds: float) -> Iterator[None]:
    """Fill ``result.cpu`` (but for the clients', which each client counts itself) with the CPU used per
    second in the window the clients count, from the end of the warm-up for ``seconds`` after the start
    event (set just before this). The readings are taken within that window, a twentieth of it in from
    each end, so that clients ending their run (and the database sessions they close) are not in it; the
    figures are rates, as the cycles per second they are divided by. A run that ends early, or a machine
    where they cannot be read, leaves them out."""
    import threading

    done = threading.Event()
    margin = seconds / 20

    def count() -> None:
        try:
            if done.wait(warmup + margin):
                return
            began, before = time.perf_counter(), _cpu_snapshot(servers)
            if done.wait(max(0.0, seconds - 2 * margin - (time.perf_counter() - began))):
                return
            elapsed, after = time.perf_counter() - began, _cpu_snapshot(servers)
        except Exception:  # no psutil, or no such figures here: the run goes on without them
            return
        result.cpu.update({part: _cpu_between(before[part], after[part]) / elapsed for part in before})

    thread = threading.Thread(target=count, name="bench-cpu", daemon=True)
    thread.start()
    try:
        yield
    except BaseException:
        done.set()
        raise
    finally:
        # The clients end their counted seconds after the second reading is due: wait for it.
        thread.join(warmup + seconds + 5)
        done.set()


SAMPLE_INTERVAL = 0.1


@contextlib.contextmanager
def _sampling(sys_obj: Any, result: RunResult) -> Iterator[None]:
    """Call ``sys_obj.sample()`` every SAMPLE_INTERVAL seconds in a thread while the body runs."""
    sample = getattr(sys_obj, "sample", None)
    if sample is None:
        yield
        return
    import threading

    seen: dict[str, list[float]] = {}
    done = threading.Event()

    def loop() -> None:
        while not done.wait(SAMPLE_INTERVAL):
            with contextlib.suppress(Exception):  # a missed sample is not a failed run
                for name, value in sample().items():
                    seen.setdefault(name, []).append(float(value))

    thread = threading.Thread(target=loop, name="bench-sampler", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        result.samples = {n: {"mean": sum(v) / len(v), "max": max(v)} for n, v in seen.items() if v}


def _collect(
    procs: Sequence[multiprocessing.process.BaseProcess],
    results: multiprocessing.queues.Queue[tuple[str, int, Any]],
    want: str,
    got: dict[int, Any],
    failures: dict[int, str],
    deadline: float,
) -> None:
    """Read messages of kind ``want`` until every live client sent one.

    Stops early for clients that reported an error or died, and at
    ``deadline`` for those that hang.
    """
    pending = set(range(len(procs))) - set(failures) - set(got)
    dead_since: dict[int, float] = {}
    while pending and time.perf_counter() < deadline:
        try:
            kind, index, payload = results.get(timeout=0.1)
        except queue.Empty:
            pass
        else:
            if kind == "error":
                failures[index] = payload
                pending.discard(index)
                if want == "ready":
                    return  # the run will be aborted; no use waiting for the rest
            elif kind == want:
                got[index] = payload
                pending.discard(index)
        for index in sorted(pending):
            code = procs[index].exitcode
            if code is None:
                continue
            # A process that exited may still have its last message in the
            # pipe; give it a moment before calling it lost.
            first_seen = dead_since.setdefault(index, time.perf_counter())
            if time.perf_counter() - first_seen > 1.0:
                failures[index] = f"client {index} exited with code {code} without reporting"
                pending.discard(index)
    for index in sorted(pending):
        late = "did not connect" if want == "ready" else "did not finish its run"
        failures[index] = f"client {index} {late} in time; terminated"


def _summarise(result: RunResult, reports: Mapping[int, ClientReport], failures: Mapping[int, str]) -> None:
    latencies = array("d")
    for report in reports.values():
        latencies.frombytes(report.latencies)
        for key, value in report.stats.items():
            result.stats[key] = result.stats.get(key, 0) + value
    result.granted = sum(r.granted for r in reports.values())
    result.refused = sum(r.refused for r in reports.values())
    result.per_client_granted = [reports[i].granted if i in reports else 0 for i in range(result.clients)]
    # Sum of per-client rates rather than total / longest elapsed: a client
    # whose last cycle overran the window (stuck behind a lock for seconds)
    # must not shrink everybody else's rate.
    result.cycles_per_s = sum(r.granted / r.elapsed_s for r in reports.values() if r.elapsed_s > 0)
    if latencies:
        ordered = sorted(latencies)
        result.p50_ms = percentile(ordered, 50) * 1000
        result.p99_ms = percentile(ordered, 99) * 1000
        result.max_ms = ordered[-1] * 1000
    if reports:
        result.cpu["clients"] = sum(r.cpu_s / r.elapsed_s for r in reports.values() if r.elapsed_s > 0)
    result.error_count = sum(r.errors for r in reports.values()) + len(failures)
    result.errors = [failures[i] for i in sorted(failures)]
    for i in sorted(reports):
        result.errors.extend(reports[i].error_samples)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

_COLUMNS = (
    ("system", "{:<16}"),
    ("backend", "{:<10}"),
    ("scenario", "{:<8}"),
    ("clients", "{:>7}"),
    ("cycles/s", "{:>9}"),
    ("refused", "{:>7}"),
    ("p50 ms", "{:>7}"),
    ("p99 ms", "{:>7}"),
    ("max ms", "{:>8}"),
    ("jain", "{:>5}"),
    ("errors", "{:>6}"),
    ("history", "{:>11}"),
    ("load", "{:>4}"),
)


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_row(r: RunResult) -> str:
    history = f"{r.history_rows}/{r.history_load_s:.0f}s" if r.history_load_s is not None else "-"
    cells = (
        r.system,
        r.backend,
        r.scenario,
        r.clients,
        f"{r.cycles_per_s:.0f}",
        r.refused,
        _fmt_ms(r.p50_ms),
        _fmt_ms(r.p99_ms),
        _fmt_ms(r.max_ms),
        f"{r.fairness:.3f}" if r.clients > 1 else "-",
        r.error_count,
        history,
        f"{r.load_before:.1f}",
    )
    return "  ".join(fmt.format(c) for (_, fmt), c in zip(_COLUMNS, cells, strict=True))


def format_cpu(r: RunResult) -> str:
    """The CPU a run used per granted cycle, by part, and the machine's cores in use."""
    if not r.cpu:
        return "cpu: not measured"
    parts = ", ".join(
        f"{part} {ms:.3f}" for part in ("clients", "server", "stores", "all") if (ms := r.cpu_ms_per_cycle(part))
    )
    machine = f"; cores in use {r.cpu['all']:.2f}" if "all" in r.cpu else ""
    return f"cpu ms/cycle: {parts}{machine}"


def format_header() -> str:
    return "  ".join(fmt.format(name) for name, fmt in _COLUMNS)


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--system", default="floor", help=f"comma list of {sorted(BUILTIN_SYSTEMS)} or module:attr")
    parser.add_argument("--backend", default="sqlite", help=f"comma list of {BACKENDS}")
    parser.add_argument("--scenario", default="hot", help=f"comma list of {SCENARIO_NAMES}")
    parser.add_argument("--clients", default="1,4,16", help="comma list of client counts")
    parser.add_argument("--per-acquire", type=int, default=1, help="semaphores taken together by one acquire")
    parser.add_argument(
        "--capacity", type=int, default=DEFAULT_CAPACITY, help="capacity of each semaphore (1: a mutex)"
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=0.0, help="uncounted seconds of cycles before each run")
    parser.add_argument("--history", type=int, default=0, help="pre-load this many old released rows before each run")
    parser.add_argument("--repeat", type=int, default=1, help="run the whole grid this many times (rounds interleave)")
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per run to PATH")
    parser.add_argument("--no-machine", action="store_true", help="do not print the machine line")
    parser.add_argument(
        "--cpu", action="store_true", help="after each run, the CPU it used per granted cycle, by part (RunResult.cpu)"
    )
    args = parser.parse_args(argv)

    backends = _csv(args.backend)
    urls = {b: default_url(b) for b in backends}
    if not args.no_machine:
        print(f"# {describe_machine(urls.values())}")
    print(format_header(), flush=True)
    grid = [
        (system, backend, scenario, int(clients))
        for system in _csv(args.system)
        for backend in backends
        for scenario in _csv(args.scenario)
        for clients in _csv(args.clients)
    ]
    failed = False
    # Whole rounds rather than N runs in a row per configuration, so that a
    # slow phase of the machine (a checkpoint, a neighbour's test suite) is
    # spread over all configurations instead of skewing one.
    for _ in range(args.repeat):
        for system, backend, scenario, clients in grid:
            template = Scenario(scenario, clients, capacity=args.capacity, per_acquire=args.per_acquire)
            result = run(
                system, urls[backend], template, clients, args.seconds, history=args.history, warmup=args.warmup
            )
            print(format_row(result), flush=True)
            if args.cpu:
                print("    " + format_cpu(result), flush=True)
            for message in result.errors:
                print("    " + message.rstrip().replace("\n", "\n    "), flush=True)
            failed = failed or bool(result.errors)
            if args.json:
                with open(args.json, "a", encoding="utf-8") as f:
                    f.write(json.dumps(result.to_json()) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    # Import ourselves under our real name and run that copy: classes pickled
    # to and from the spawned children then live in module "harness", which
    # the children can import, rather than in "__main__", which differs per
    # process.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness

    sys.exit(harness.main())
