"""The harness of the fault runs: a semaphore, its fenced register, worker processes (direct to the
database or through ``permits serve`` instances), faults, and at the end the database's state and the
checker's verdict.

    run = FaultRun(tmp_path, db_url, ns)
    svc = run.service()                              # a real `permits serve`, sweeping every second
    a, b = run.services({}, {"skew": "+1h"})         # several at once
    run.workers(2, db_url); run.workers(2, svc.url)  # two through the library, two through the service
    run.sleep(2); run.kill_worker(...)               # faults, each recorded in the harness's history
    report = run.finish()                            # stop, read the database, check
    assert not report.violations, report

The harness's own history file records every fault it injects (``kill`` events name their target, so the
checker knows which operations a kill cut short).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

import permits
from permits import LeaseNotFound
from tests._private_db import free_port
from tests._service import ROOT, Service
from tests.faults.checker import Final, Report, check
from tests.faults.history import History, Recorder, merge
from tests.faults.worker import install_register, sync_url

SWEEP_INTERVAL = 1.0
#: how long an unknown outcome is retried before a worker gives up on it (longer than any fault lasts)
SETTLE = 40.0
#: how long workers get to finish their round after the stop file appears (an acquire may be waiting)
STOP_GRACE = 60.0
#: Debian's libfaketime (package faketime), on whatever architecture
LIBFAKETIME = ([*sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")), "/usr/lib/faketime/libfaketime.so.1"])[0]


class FaultRun:
    def __init__(
        self,
        tmp_path: Path,
        db_url: str,
        ns: str,
        *,
        capacity: int = 2,
        ttl: float = 2.0,
        hold: float = 0.05,
        acquire_timeout: float = 1.0,
        slack: float = Final.slack,
        fair: bool = False,
    ) -> None:
        self.db_url = db_url
        self.ns = ns
        self.dir = tmp_path / "history"
        self.dir.mkdir(parents=True)
        self.stop_file = tmp_path / "stop"
        self.rec = Recorder(self.dir / "harness.jsonl", "harness")
        self.sem, self.resource = f"{ns}sem", f"{ns}register"
        self.capacity, self.ttl, self.hold, self.acquire_timeout = capacity, ttl, hold, acquire_timeout
        #: how late past TTL + sweep interval a killed holder's lease may end (see checker.killed_return)
        self.slack = slack
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.owners: dict[str, str] = {}
        self.urls: dict[str, str] = {}  # where each worker goes
        self.killed: set[str] = set()
        self.instances: list[Service] = []
        self._n = 0
        with permits.connect(db_url, owner=f"{ns}harness", auto_upgrade=True) as client:
            client.create_semaphore(self.sem, capacity, fair=fair)
        engine = create_engine(sync_url(db_url))
        install_register(engine, self.resource)
        engine.dispose()

    # ---- processes

    def service(
        self,
        db_url: str | None = None,
        *,
        port: int | None = None,
        skew: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Service:
        """A ``permits serve`` instance, sweeping every second; ``skew`` runs it under libfaketime
        (``FAKETIME``, e.g. ``+1h``: its wall clock is that far off); ``env`` adds settings."""
        env = {"PERMITS_MAINTENANCE__SWEEP_INTERVAL": str(SWEEP_INTERVAL), **(env or {})}
        if skew is not None:
            env.update({"LD_PRELOAD": LIBFAKETIME, "FAKETIME": skew, "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
        for attempt in range(3):
            try:
                svc = Service(db_url or self.db_url, env=env, args=("--port", str(port or free_port())))
                break
            except RuntimeError as exc:
                # A free port can be taken before the service binds it (a TCP proxy's outgoing connection,
                # say; CI met it once): a port of its own choosing, it takes another.
                if port is not None or "address already in use" not in str(exc) or attempt == 2:
                    raise
        self.instances.append(svc)
        self.rec.event("service_start", url=svc.url, pid=svc.process.pid, skew=skew)
        return svc

    def services(self, *specs: dict[str, Any]) -> list[Service]:
        """Start several instances at once (each ``spec`` holds the arguments of ``service``)."""
        with ThreadPoolExecutor(len(specs)) as pool:
            return list(pool.map(lambda spec: self.service(**spec), specs))

    def kill_service(self, svc: Service) -> None:
        self.rec.event("service_kill", url=svc.url, pid=svc.process.pid)
        svc.process.kill()
        svc.stop()

    def restart_service(self, svc: Service) -> Service:
        """A new instance on the same port and database as ``svc`` (which is dead)."""
        db_url = svc.process.args[svc.process.args.index("--db") + 1]  # type: ignore[union-attr]
        port = int(svc.url.rsplit(":", 1)[1])
        return self.service(db_url, port=port)

    def worker(self, url: str, **options: Any) -> str:
        """Start one worker on ``url`` (a database or a service); returns its name."""
        self._n += 1
        proc = f"w{self._n}"
        owner = f"{self.ns}{proc}"
        args = {
            "proc": proc,
            "owner": owner,
            "url": url,
            "register_url": self.db_url,
            "sem": self.sem,
            "resource": self.resource,
            "ttl": self.ttl,
            "hold": self.hold,
            "acquire_timeout": self.acquire_timeout,
            "settle": SETTLE,
            "seed": self._n,
            "history": str(self.dir / f"{proc}.jsonl"),
            "stop_file": str(self.stop_file),
            **options,
        }
        with (self.dir / f"{proc}.err").open("wb") as err:
            self.procs[proc] = subprocess.Popen(
                [sys.executable, "-m", "tests.faults.worker", json.dumps(args)],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=subprocess.STDOUT,
            )
        self.owners[proc] = owner
        self.urls[proc] = url
        return proc

    def workers(self, n: int, url: str, **options: Any) -> list[str]:
        return [self.worker(url, **options) for _ in range(n)]

    def kill_worker(self, proc: str) -> None:
        self.rec.event("kill", target=proc)
        self.killed.add(proc)
        self.procs[proc].kill()
        self.procs[proc].wait()

    def history(self) -> History:
        return merge(self.dir)

    def wait_for(self, check: Any, timeout: float = 60.0, what: str = "") -> Any:
        deadline = time.monotonic() + timeout
        while not (value := check()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what or check}\n{self.logs()}")
            self._watch()
            time.sleep(0.1)
        return value

    def acquired(self, proc: str | None = None) -> int:
        """How many acquires (of ``proc``) were granted so far."""
        return sum(1 for o in self.history().of("acquire") if o.outcome == "ok" and proc in (None, o.proc))

    def progress(self, grants: int, *, procs: list[str] | None = None, timeout: float = 60.0) -> None:
        """Wait until ``grants`` more acquires (of ``procs``, or of anyone) were granted."""

        def count() -> int:
            return sum(self.acquired(p) for p in procs) if procs else self.acquired()

        before = count()
        self.wait_for(lambda: count() >= before + grants, timeout, f"{grants} more grants")

    def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._watch()
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _watch(self) -> None:
        """A worker that died by itself (not by a kill) is a bug in the test or the client: stop at once."""
        for proc, popen in self.procs.items():
            if popen.poll() is not None and proc not in self.killed and not self.stop_file.exists():
                raise AssertionError(f"worker {proc} exited {popen.returncode} by itself:\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for path in sorted(self.dir.glob("*.err")):
            body = path.read_text(errors="replace").strip()
            if body:
                parts.append(f"--- {path.name}\n{body[-3000:]}")
        for svc in self.instances:
            parts.append(f"--- service {svc.url}\n{svc.log()[-3000:]}")
        return "\n".join(parts)

    # ---- the end

    def stop(self) -> None:
        """Let every worker finish its round and exit. One that does not within STOP_GRACE is hung (every
        operation it makes has a timeout, so a hang is a bug: a deadlock, a wait with no bound): it is
        killed, and the run fails rather than count it as one more kill."""
        self.stop_file.touch()
        for popen in self.procs.values():
            if popen.poll() is None:
                os.kill(popen.pid, signal.SIGCONT)  # a worker frozen on purpose finishes its round too
        deadline = time.monotonic() + STOP_GRACE
        hung = []
        for proc, popen in self.procs.items():
            if popen.poll() is None:
                try:
                    popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    hung.append(proc)
                    self.kill_worker(proc)
        if hung:
            raise AssertionError(f"workers {hung} did not stop within {STOP_GRACE:.0f} s: hung\n{self.logs()}")

    def read_final(self, db_url: str | None = None) -> Final:
        """Read every lease a worker asked for, the register's log and the reconcile check, directly from
        the database."""
        history = self.history()
        leases: dict[tuple[str, str], dict[str, Any]] = {}
        with permits.connect(db_url or self.db_url, owner=f"{self.ns}harness") as client:
            refs = {(o["owner"], o["key"]) for o in history.of("acquire")}
            for owner, key in sorted(refs):
                try:
                    lease = client.get_lease(key, owner=owner)
                    leases[(owner, key)] = {**lease.to_dict(), "held": lease.held}
                except LeaseNotFound:
                    pass
            drift = [d for d in client.reconcile() if d.name == self.sem]
        engine = create_engine(sync_url(db_url or self.db_url))
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT version, token, wid FROM fault_register_log WHERE resource = :r"), {"r": self.resource}
            ).all()
        engine.dispose()
        return Final(
            t=time.monotonic(),
            leases=leases,
            register={self.resource: [(int(v), int(t), str(w)) for v, t, w in rows]},
            drift=[str(d) for d in drift],
            capacity={self.sem: self.capacity},
            sweep_interval=SWEEP_INTERVAL,
            slack=self.slack,
        )

    def finish(self) -> Report:
        """Stop the workers, give the leases that killed holders left time to be reclaimed (their TTL plus a
        sweep plus the checker's slack, no longer than needed), read the database and check the history.
        Also stops the services."""
        self.stop()
        history = self.history()
        killed = history.killed_at()
        if killed:
            released = {(o["owner"], o["key"]) for o in history.of("release") if o.outcome == "ok"}
            refs = {(o["owner"], o["key"]) for o in history.of("acquire") if o.proc in killed} - released
            deadline = max(killed.values()) + self.ttl + SWEEP_INTERVAL + self.slack
            while time.monotonic() < deadline and self._any_open(refs):
                time.sleep(0.5)
        final = self.read_final()
        report = check(self.history(), final)
        self.close()
        return report

    def _any_open(self, refs: set[tuple[str, str]]) -> bool:
        """Whether any of these leases has not ended yet."""
        with permits.connect(self.db_url, owner=f"{self.ns}harness") as client:
            for owner, key in refs:
                try:
                    if client.get_lease(key, owner=owner).end_reason is None:
                        return True
                except LeaseNotFound:
                    pass
        return False

    def close(self) -> None:
        self.stop_file.touch()
        for popen in self.procs.values():
            if popen.poll() is None:
                os.kill(popen.pid, signal.SIGCONT)
                popen.kill()
                popen.wait()
        for svc in self.instances:
            svc.stop()
        self.rec.close()


def describe(report: Report, run: FaultRun) -> str:
    return f"{report}\nhistory in {run.dir}\n{run.logs()}"
