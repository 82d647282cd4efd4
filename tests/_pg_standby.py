"""A PostgreSQL 15 primary and a streaming hot standby on this machine, loopback only (issue 7).

Both are Debian's ``postgresql-15`` binaries, run as the ``postgres`` user on data directories of their own
under one ``tempfile.mkdtemp()`` directory: the primary on 127.0.0.1:5441, the standby on 127.0.0.1:5442.
The machine's own cluster (5432, /etc/postgresql) is never touched. Use::

    with PgPrimaryStandby() as pg:          # 3-5 s: initdb, start, pg_basebackup -R, start
        pg.primary_url                      # postgresql://postgres@127.0.0.1:5441/test
        pg.wait_replayed()                  # the standby has replayed everything the primary wrote so far
        pg.stop_primary()                   # the primary crashes (immediate shutdown: no final checkpoint)
        pg.promote()                        # the standby becomes a primary, on the same port
    # both stopped, the directory removed

Replication is asynchronous by default, as most hot standbys are: a commit acknowledged by the primary may
be missing on the standby when the primary dies, so a test that promotes after a crash must first
``wait_replayed()`` or start the pair with ``synchronous=True`` (the primary's commits then wait until the
standby has applied them, ``synchronous_commit = remote_apply``).

A missing ``postgresql-15`` is installed with apt-get when the tests run as root on Debian, and is a clear
error otherwise.
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg

from tests._galera import (
    KEEP_ENV,
    chown_tree,
    ensure_debian_packages,
    ensure_ports_free,
    kill_processes_using,
    kill_tree,
    service_account,
)

PG_BIN = Path("/usr/lib/postgresql/15/bin")
REQUIRED_PACKAGES = {str(PG_BIN / tool): "postgresql-15" for tool in ("initdb", "postgres", "pg_basebackup", "pg_ctl")}
#: a server accepting connections after start or crash recovery, on a loaded 2-core machine
START_TIMEOUT = 60.0
POLL_INTERVAL = 0.1
#: the standby's replication slot on the primary: the primary keeps every WAL segment the standby still needs
SLOT = "permits_standby"

#: signal to the postmaster for each pg_ctl shutdown mode (``kill``: SIGKILL it and all its processes)
SHUTDOWN_SIGNALS = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}

#: postgresql.conf of the primary; the standby inherits it through the base backup
SHARED_SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "wal_level": "replica",
    "max_wal_senders": "5",
    "max_replication_slots": "5",
    "hot_standby": "on",  # the standby answers reads while it replays
    # the standby tells the primary which rows its queries still read, so that replay never cancels them
    "hot_standby_feedback": "on",
    "shared_buffers": "32MB",
    "max_connections": "100",
    # durability as a user runs it: commits are flushed before they are acknowledged
    "fsync": "on",
    "synchronous_commit": "on",
}


class _Server:
    """One postmaster: its data directory, port and process."""

    def __init__(self, role: str, directory: Path, port: int, account: pwd.struct_passwd | None) -> None:
        self.role = role
        self.data = directory / role
        self.socket_dir = directory
        self.port = port
        self.log = directory / f"{role}.log"
        self.account = account
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def launch(self, settings: dict[str, str]) -> None:
        """Start the postmaster with ``settings`` on top of postgresql.conf, and wait until it answers."""
        assert not self.running, f"the {self.role} is already running"
        command = [str(PG_BIN / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.socket_dir)]
        for name, value in settings.items():
            command += ["-c", f"{name}={value}"]
        with self.log.open("ab") as log:
            # a session of its own, so that a Ctrl-C meant for pytest does not shut it down half-way
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                **as_account(self.account),
            )
        self.wait_answering()

    def wait_answering(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self.running:
                code = self.process.returncode if self.process else None
                raise RuntimeError(f"the {self.role} exited ({code}) at start:\n{self.log_tail()}")
            try:
                self.query("SELECT 1", database="postgres")
                return
            except psycopg.OperationalError as exc:  # "the database system is starting up", refused
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {self.role} did not answer within {timeout:.0f}s: {exc}") from None
            time.sleep(POLL_INTERVAL)

    def shut_down(self, mode: str) -> None:
        """Stop the postmaster the way ``pg_ctl stop -m <mode>`` would, or SIGKILL everything (``kill``)."""
        if self.process is None:
            return
        if mode == "kill":
            # every process at once: a backend that outlived its postmaster would keep the shared memory
            kill_tree(self.process.pid)
        elif mode in SHUTDOWN_SIGNALS:
            if self.running:
                self.process.send_signal(SHUTDOWN_SIGNALS[mode])
            try:
                self.process.wait(START_TIMEOUT)
            except subprocess.TimeoutExpired:
                kill_tree(self.process.pid)
        else:
            raise ValueError(f"unknown shutdown mode {mode!r}: one of {[*SHUTDOWN_SIGNALS, 'kill']}")
        self.process.wait()
        self._remove_leftover_shared_memory()

    def _remove_leftover_shared_memory(self) -> None:
        """A SIGKILLed postmaster leaves its postmaster.pid and a small System V shared memory segment behind
        (any real shutdown, immediate included, removes both); without this every killed run would leak one.
        Line 7 of postmaster.pid holds the segment's key and id."""
        try:
            lines = (self.data / "postmaster.pid").read_text().splitlines()
        except OSError:
            return
        key_and_id = lines[6].split() if len(lines) > 6 else []
        if len(key_and_id) == 2 and key_and_id[1].isdigit():
            subprocess.run(["ipcrm", "-m", key_and_id[1]], capture_output=True, check=False)

    def query(self, statement: str, params: tuple[Any, ...] = (), *, database: str = "postgres") -> list[Any]:
        """Run one statement as postgres, autocommit, and return its rows (none for a statement without)."""
        with (
            psycopg.connect(self.conninfo(database), autocommit=True, connect_timeout=3) as connection,
            connection.cursor() as cursor,
        ):
            cursor.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    def conninfo(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return f"--- {self.log.name}\n{self.log.read_text(errors='replace')[-chars:]}"
        except OSError:
            return f"(the {self.role} wrote no log)"


class PgPrimaryStandby:
    """A primary and a streaming hot standby; ``start()`` returns when the standby has replayed database
    ``test``, created on the primary."""

    def __init__(self, primary_port: int = 5441, standby_port: int = 5442, *, synchronous: bool = False) -> None:
        self.primary_port = primary_port
        self.standby_port = standby_port
        self.synchronous = synchronous
        self.dir: Path | None = None
        self.primary: _Server | None = None
        self.standby: _Server | None = None
        #: seconds each step of start() took, for the test's report
        self.timings: dict[str, float] = {}

    # ---- life cycle

    def start(self) -> None:
        ensure_debian_packages(REQUIRED_PACKAGES, why="the PostgreSQL primary/standby test pair")
        ensure_ports_free([self.primary_port, self.standby_port])
        account = service_account("postgres")
        self.dir = Path(tempfile.mkdtemp(prefix="permits-pg-standby-"))
        chown_tree(self.dir, account)
        atexit.register(self.stop)  # the test process ending without __exit__ must not leave servers behind
        self.primary = _Server("primary", self.dir, self.primary_port, account)
        self.standby = _Server("standby", self.dir, self.standby_port, account)
        try:
            self._timed("initdb", self._init_primary)
            self._timed("start_primary", lambda: self._primary().launch(self._primary_settings()))
            self._timed("base_backup", self._take_base_backup)
            # the synchronous settings are the primary's alone (command line, not postgresql.conf): once promoted,
            # the standby has no standby of its own to wait for
            self._timed("start_standby", lambda: self._standby().launch({}))
            self._timed("create_test_database", self._create_test_database)
            self.timings["total"] = round(sum(self.timings.values()), 1)
        except BaseException as exc:
            report = self.logs()
            self.stop()
            if isinstance(exc, Exception):
                raise RuntimeError(f"the PostgreSQL primary/standby did not come up: {exc}\n{report}") from exc
            raise

    def stop(self) -> None:
        """Stop both servers (immediate shutdown: the data is thrown away) and remove the directory."""
        atexit.unregister(self.stop)
        for server in (self.standby, self.primary):
            if server is not None:
                server.shut_down("immediate")
        if self.dir is not None:
            kill_processes_using(self.dir)  # a backend whose postmaster died with SIGKILL
            if not os.environ.get(KEEP_ENV):
                shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = self.primary = self.standby = None

    def __enter__(self) -> PgPrimaryStandby:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- what tests use

    @property
    def primary_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.primary_port}/test"

    @property
    def standby_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.standby_port}/test"

    def wait_replayed(self, timeout: float = 30.0) -> None:
        """Wait until the standby has replayed everything the primary had written when this was called."""
        (target,) = self._primary().query("SELECT pg_current_wal_lsn()::text")[0]
        deadline = time.monotonic() + timeout
        while True:
            (replayed, caught_up) = self._standby().query(
                "SELECT pg_last_wal_replay_lsn()::text, pg_wal_lsn_diff(pg_last_wal_replay_lsn(), %s::pg_lsn) >= 0",
                (target,),
            )[0]
            if caught_up:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the standby replayed up to {replayed}, not {target}, within {timeout:.0f}s")
            time.sleep(POLL_INTERVAL)

    def promote(self, timeout: float = START_TIMEOUT) -> None:
        """Promote the standby (``pg_ctl promote``); returns once it accepts writes."""
        standby = self._standby()
        self._run_as_postgres(
            [str(PG_BIN / "pg_ctl"), "promote", "-D", str(standby.data), "-w", "-t", str(int(timeout))]
        )
        deadline = time.monotonic() + timeout
        while standby.query("SELECT pg_is_in_recovery()")[0][0]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the standby still in recovery {timeout:.0f}s after pg_ctl promote")
            time.sleep(POLL_INTERVAL)

    def stop_primary(self, mode: str = "immediate") -> None:
        """Stop the primary: ``smart``, ``fast`` or ``immediate`` as ``pg_ctl stop -m`` (immediate is a crash
        as far as the data is concerned: no final checkpoint), or ``kill`` (SIGKILL all its processes)."""
        self._primary().shut_down(mode)

    def log_tail(self, role: str, chars: int = 4000) -> str:
        server = self.primary if role == "primary" else self.standby
        return server.log_tail(chars) if server is not None else f"(no {role})"

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(self.log_tail(role, chars) for role in ("primary", "standby"))

    # ---- start(), step by step

    def _timed(self, step: str, action: Any) -> None:
        began = time.monotonic()
        action()
        self.timings[step] = round(time.monotonic() - began, 1)

    def _primary(self) -> _Server:
        assert self.primary is not None, "not started"
        return self.primary

    def _standby(self) -> _Server:
        assert self.standby is not None, "not started"
        return self.standby

    def _primary_settings(self) -> dict[str, str]:
        if not self.synchronous:
            return {}
        # every commit waits until the standby has applied it: nothing acknowledged is lost by a failover
        return {"synchronous_standby_names": "*", "synchronous_commit": "remote_apply"}

    def _init_primary(self) -> None:
        primary = self._primary()
        # trust for every local and loopback connection, replication included; --no-sync skips only initdb's
        # own final fsync of the new directory, the server keeps fsync=on
        self._run_as_postgres(
            [
                str(PG_BIN / "initdb"),
                "-D",
                str(primary.data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ]
        )
        settings = "".join(f"{name} = {value}\n" for name, value in SHARED_SETTINGS.items())
        with (primary.data / "postgresql.conf").open("a") as conf:
            conf.write("\n# added by tests/_pg_standby.py\n" + settings)

    def _take_base_backup(self) -> None:
        """Copy the running primary into the standby's directory. -R writes standby.signal and the
        primary_conninfo; -C -S creates the replication slot the standby streams from; --checkpoint=fast: a
        spread checkpoint would keep us waiting for nothing."""
        self._run_as_postgres(
            [
                str(PG_BIN / "pg_basebackup"),
                *("-h", "127.0.0.1", "-p", str(self.primary_port), "-U", "postgres"),
                *("-D", str(self._standby().data)),
                *("-R", "-X", "stream", "-C", "-S", SLOT, "--checkpoint=fast", "--no-sync"),
            ]
        )

    def _create_test_database(self) -> None:
        self._primary().query("CREATE DATABASE test")
        self.wait_replayed()

    def _run_as_postgres(self, command: list[str]) -> None:
        assert self.dir is not None
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            cwd=self.dir,
            check=False,
            **as_account(self._primary().account),
        )
        if done.returncode != 0:
            raise RuntimeError(f"{Path(command[0]).name} failed ({done.returncode}):\n{done.stdout}{done.stderr}")


def as_account(account: pwd.struct_passwd | None) -> dict[str, Any]:
    """Popen arguments that run a server as ``account`` (with its group only, none of root's)."""
    if account is None:
        return {}
    return {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
