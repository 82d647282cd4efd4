"""Jepsen-style fault runs on the shared backends: workers (real processes, some on the library, some
through real ``permits serve`` instances) take turns on a semaphore and write their fencing tokens to a
fenced register, while one fault is injected; then the checker (``tests/faults/checker.py``) reads the
whole history and the database's state and lists any violation. Database restarts, which need servers of
their own, are in ``test_database_restarts.py``; the long mixed run is ``test_soak.py``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

import permits
from tests._proxy import CuttingProxy
from tests.conftest import IN_CI, THOROUGH
from tests.faults.harness import LIBFAKETIME, SWEEP_INTERVAL, FaultRun, describe
from tests.faults.history import FAIL, OK, History

pytestmark = pytest.mark.slow


@pytest.fixture
def run(tmp_path: Path, db_url: str, ns: str) -> Iterator[FaultRun]:
    fault_run = FaultRun(tmp_path, db_url, ns)
    try:
        yield fault_run
    finally:
        fault_run.close()


def _holding(history: History, proc: str) -> bool:
    """Whether ``proc``'s last acquire was granted and it has not started releasing it."""
    acquires = [o for o in history.of("acquire") if o.proc == proc]
    if not acquires or acquires[-1].outcome != OK:
        return False
    key = acquires[-1]["key"]
    return not any(o.proc == proc and o["key"] == key for o in history.of("release"))


def _kill_while_holding(run: FaultRun, proc: str) -> bool:
    """SIGKILL ``proc`` as soon as it holds a lease (within 20 s); whether it held one when killed."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not _holding(run.history(), proc):
        time.sleep(0.01)
    run.kill_worker(proc)
    return _holding(run.history(), proc)


def _kill_a_holder(run: FaultRun, url: str, tries: int = 3) -> bool:
    """Start a worker on ``url`` and SIGKILL it while it holds a lease; another, if the kill landed just
    as it began to release (it holds for up to 0.5 s a round). Whether one was killed holding."""
    return any(_kill_while_holding(run, run.worker(url, hold=0.5)) for _ in range(tries))


def _assert_clean(run: FaultRun, report: object) -> None:
    print(report)  # the counts of ok / fail / unknown outcomes, shown with -s
    assert not report.violations, describe(report, run)  # type: ignore[attr-defined]


def test_killed_holders(run: FaultRun, db_url: str) -> None:
    """SIGKILL holders mid-lease (one on the library, one through the service): their permits come back
    within TTL + sweep, and nothing else goes wrong meanwhile. Nothing here stops the sweeper, so the
    checker's slack is tight: the sweep interval plus 2 s for a loaded machine (the faults that hit the
    instance that sweeps, or its database, keep the default)."""
    run.slack = 2.0
    svc = run.service()
    run.worker(db_url)
    run.worker(svc.url)
    run.wait_for(lambda: run.acquired() >= 3, what="the first grants")
    caught = [_kill_a_holder(run, db_url), _kill_a_holder(run, svc.url)]
    run.worker(db_url)  # replacements
    run.worker(svc.url)
    run.sleep(1.0)
    report = run.finish()
    _assert_clean(run, report)
    assert all(caught), "on one path, no victim was killed while holding a lease"


@pytest.mark.parametrize("path", ["library", "service"])
def test_holder_paused_past_its_ttl(run: FaultRun, db_url: str, path: str) -> None:
    """SIGSTOP a holder past its TTL, then SIGCONT: its lease was reclaimed meanwhile, the register refuses
    its stale token, and its release finds the lease lost. The paused holder talks to the database itself,
    or goes through the service."""
    svc = run.service()
    victim = run.worker(db_url if path == "library" else svc.url, stop_self_at=2)
    pid = run.procs[victim].pid
    # The others start once the victim holds its lease, stopped: on SQLite, a process can wait a long time
    # for the write lock that others keep taking (docs/primitives.md), and a loaded CI machine once kept the
    # victim from its second grant for a minute.
    run.wait_for(lambda: _stopped(pid), what="the victim to stop itself while holding")
    run.worker(db_url)
    run.worker(svc.url)
    stopped = run.history()
    token = next(e["token"] for e in stopped.events if e["kind"] == "self_stop")
    run.sleep(run.ttl + SWEEP_INTERVAL + 0.5)
    run.wait_for(
        lambda: any(w.outcome == OK and w["token"] > token for w in run.history().of("write")),
        what="a newer holder's write",
    )
    run.rec.event("sigcont", target=victim)
    os.kill(pid, signal.SIGCONT)
    run.wait_for(lambda: _after_resume(run.history(), victim, "release"), what="the victim's release")
    history = run.history()
    report = run.finish()
    _assert_clean(run, report)
    write = _after_resume(history, victim, "write")
    release = _after_resume(history, victim, "release")
    assert write is not None and write.outcome == FAIL and write["highest"] > token, write
    assert release is not None and release.outcome == FAIL and release["result"] == "lost", release


def _freshly_held(history: History, procs: Collection[str], within: float) -> bool:
    """Whether one of ``procs`` holds a lease it was granted less than ``within`` seconds ago (by the
    history's clock, which is the machine's CLOCK_MONOTONIC)."""
    now = time.monotonic()
    return any(
        _holding(history, proc)
        and now - max(o.t1 for o in history.of("acquire") if o.proc == proc and o.outcome == OK) < within
        for proc in procs
    )


def _assert_hit(run: FaultRun, kind: str, through: Collection[str], held_up: bool = True) -> None:
    """The clean report is about work that the faults of ``kind`` met: operations of the workers
    ``through`` the instance it struck, under way within a second of each (``History.met``), and, for a
    fault that lasts (an outage, a stall), some of them visibly held up by it (``History.held_up``). A
    cut, which the store's retry heals in milliseconds, need not hold any up."""
    history = run.history()
    met = history.met(kind, through)
    assert met, f"no operation through the instance was under way around the {kind}"
    if held_up:
        assert history.held_up(kind, through), [(o.op, o.outcome, round(o.t1 - o.t0, 2)) for o in met]


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def _after_resume(history: History, proc: str, op: str) -> object | None:
    resumed = [e["t"] for e in history.events if e["kind"] == "resumed" and e["proc"] == proc]
    later = [o for o in history.of(op) if o.proc == proc and resumed and o.t0 > resumed[0] and o.t1 < float("inf")]
    return later[0] if later else None


def test_service_killed_and_restarted(run: FaultRun, db_url: str) -> None:
    """kill -9 one of two service instances under load, then start it again on the same port."""
    svc, other = run.services({}, {})
    through = run.workers(2, svc.url)
    run.worker(other.url)
    run.worker(db_url)
    run.wait_for(lambda: run.acquired() >= 4, what="the first grants")
    run.kill_service(svc)
    run.sleep(1.0)
    run.restart_service(svc)
    run.rec.event("service_kill_end")
    run.progress(2, procs=through)  # through the new instance
    report = run.finish()
    _assert_clean(run, report)
    _assert_hit(run, "service_kill", through)


def _turns_with_several_grants(svc: Any) -> int:
    """How many of an instance's turns granted more than one request (its ``permits_turn_grants``)."""
    text = httpx.get(f"{svc.url}/metrics", timeout=10).text
    count = re.search(r"^permits_turn_grants_count ([0-9.e+]+)$", text, re.M)
    one = re.search(r'^permits_turn_grants_bucket\{le="1\.0"\} ([0-9.e+]+)$', text, re.M)
    assert count is not None and one is not None, text
    return int(float(count.group(1)) - float(one.group(1)))


@pytest.mark.parametrize("backend", ["mysql", "postgresql"])
@pytest.mark.parametrize("fault", ["kill", "cut"])
def test_turns_under_faults(tmp_path: Path, db_url: str, ns: str, fault: str) -> None:
    """Eight workers through one instance on a semaphore of capacity 3, so that its line works in turns of
    several grants and releases (group commit), while that instance is killed and started again, or its
    database link cut twice; others go through a second instance and to the database. The checker must
    find nothing wrong, and the instance must have granted several requests in one turn, before the fault
    and after it."""
    run = FaultRun(tmp_path, db_url, ns, capacity=3, hold=0.01)
    try:
        url = make_url(db_url)
        assert url.host is not None and url.port is not None
        with CuttingProxy((url.host, url.port)) as proxy:
            via = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
            busy, other = run.services({"db_url": via}, {})
            through = run.workers(8, busy.url)
            run.workers(2, other.url)
            run.worker(db_url)
            run.wait_for(lambda: _turns_with_several_grants(busy) > 0, what="a turn of several grants")
            for _ in range(2):
                if fault == "kill":
                    run.kill_service(busy)  # recorded as service_kill
                    run.sleep(0.5)
                    busy = run.restart_service(busy)
                else:
                    run.rec.event("cut")
                    proxy.cut_all()
                run.progress(10, procs=through)
            run.wait_for(lambda: _turns_with_several_grants(busy) > 0, what="a turn of several grants after it")
            report = run.finish()
        _assert_clean(run, report)
    finally:
        run.close()


@pytest.mark.parametrize("backend", ["mysql", "postgresql"])
@pytest.mark.parametrize("fault", ["cut", "stall", "stall-past-ttl"])
def test_service_database_link(run: FaultRun, db_url: str, fault: str) -> None:
    """One instance reaches the database through a proxy that cuts its connections, or stalls them (no
    byte lost, none delivered, for seconds) and then cuts them while stalled. A stall past the TTL lets
    the leases granted through that instance expire and be reclaimed by others while their statements,
    commits and answers are held up, then delivers them all late."""
    url = make_url(db_url)
    assert url.host is not None and url.port is not None
    with CuttingProxy((url.host, url.port)) as proxy:
        via = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        faulty, healthy = run.services({"db_url": via}, {})
        # Past the TTL, the stall is there to hold up leases that are held: workers through that instance
        # then hold theirs for a quarter to a half of the TTL, and each stall begins just after one of them
        # was granted, so that its lease is surely held across the stall. (Started at a random moment, both
        # stalls could meet neither worker holding: CI saw that once, with no lease run out.)
        past_ttl = fault == "stall-past-ttl"
        through = run.workers(2, faulty.url, **({"hold": run.ttl / 2, "hold_min": run.ttl / 4} if past_ttl else {}))
        run.worker(healthy.url)
        run.worker(db_url)
        run.wait_for(lambda: run.acquired() >= 4, what="the first grants")
        for round_ in range(2):
            if past_ttl:
                run.wait_for(lambda: _freshly_held(run.history(), through, within=run.ttl / 8), what="a fresh grant")
            run.rec.event(fault)
            if fault == "cut":
                proxy.cut_all()
                run.sleep(0.7)
            else:
                proxy.stall()
                run.sleep(1.5 if fault == "stall" else run.ttl * 1.75)
                if round_ == 1:
                    proxy.cut_all()  # the second stall ends in a cut of the stalled connections
                proxy.resume()
                run.rec.event(f"{fault}_end")
                run.sleep(0.7)
        run.progress(3)
        report = run.finish()
    _assert_clean(run, report)
    _assert_hit(run, fault, through, held_up=fault != "cut")
    if fault == "stall-past-ttl":  # the stall did what it is for: leases ran out while it held them up
        assert report.stats.get("ended_expired", 0) + report.stats.get("ended_swept", 0) > 0, report.stats


#: the reply deadlines of the partial stall: an instance's (beside its lock wait of 1 s), and a library
#: worker's (the workers' lock wait is 2 s; the deadline must be above two of them)
INSTANCE_REPLY_TIMEOUT, WORKER_REPLY_TIMEOUT = 3.0, 5.0


@pytest.mark.parametrize("backend", ["mysql", "postgresql"])
def test_partial_stall_of_one_instance_and_two_clients(tmp_path: Path, db_url: str, ns: str) -> None:
    """The links that one instance and two library workers have open hang, and new ones work (one route
    through a load balancer failing, say), for longer than their reply deadlines; then the held bytes flow
    again. Each cuts its hung connections at its deadline, ends their server sessions and retries on new
    ones, so the requests the links held reach closed sessions when they come through.

    The harness makes the held requests count: as the links start to hang it asks for the whole capacity
    (the semaphore is fair, so the workers' retries queue behind it and are told there is no room), and it
    gives the capacity back just before the links flow again. A held acquire that still ran then would find
    room and grant a key its worker was told had none, which the checker reports. With the ending turned
    off, every PostgreSQL run of four had such a grant; the MariaDB runs had none (there the test then
    fails only for the ending it does not see), and a plain semaphore, which showed them on both, cannot be
    held whole by the harness against the workers' retries. tests/faults/test_connection_cut.py shows the
    same case in one process, step by step, on both servers."""
    run = FaultRun(tmp_path, db_url, ns, fair=True)
    try:
        url = make_url(db_url)
        assert url.host is not None and url.port is not None
        with CuttingProxy((url.host, url.port)) as proxy, permits.connect(db_url, owner=f"{ns}blocker") as blocker:
            via = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
            faulty_env = {"PERMITS_LOCK_WAIT_TIMEOUT": "1", "PERMITS_REPLY_TIMEOUT": str(INSTANCE_REPLY_TIMEOUT)}
            (faulty,) = run.services({"db_url": via, "env": faulty_env})
            through = [*run.workers(2, faulty.url), *run.workers(2, via, reply_timeout=WORKER_REPLY_TIMEOUT)]
            run.wait_for(lambda: run.acquired() >= 4, what="the first grants")
            for round_ in range(3 if THOROUGH else 2):
                run.rec.event("partial_stall")
                stalled = time.monotonic()
                proxy.stall(new_too=False)
                # The stalled holders' leases run out within their TTL; then the capacity is the harness's.
                whole = {run.sem: run.capacity}
                held = blocker.acquire(whole, key=f"{ns}blocker-{round_}", ttl=30, timeout=run.ttl + 10)
                run.rec.event("capacity_held")
                # Every held try is retried, and at least a second after the capacity was the harness's.
                run.sleep(max(stalled + WORKER_REPLY_TIMEOUT + 2 - time.monotonic(), 1.0))
                blocker.release(held)
                proxy.resume()
                run.rec.event("partial_stall_end")
                run.sleep(1)
            run.progress(3, procs=through)
            ended = _reply_cuts(faulty, "ended")
            report = run.finish()
        _assert_clean(run, report)
        _assert_hit(run, "partial_stall", through)
        assert ended >= 1, "the instance ended none of the sessions whose links its deadline cut"
    finally:
        run.close()


def _reply_cuts(svc: Any, event: str) -> float:
    """An instance's ``permits_store_reply_cuts_total`` for ``event``."""
    text = httpx.get(f"{svc.url}/metrics", timeout=10).text
    found = re.search(rf'^permits_store_reply_cuts_total\{{event="{event}"\}} ([0-9.e+]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("skew", ["+1h", "-1h"], ids=["ahead", "behind"])
def test_wall_clock_skew_on_one_instance(run: FaultRun, db_url: str, backend: str, skew: str) -> None:
    """One instance runs an hour ahead, or behind (libfaketime). Leases are timed on the database's clock: the leases
    it grants last their TTL from the database's now, and a holder killed through it comes back in time."""
    if backend == "sqlite":
        # SQLite has no clock of its own: julianday('now') is the clock of the process running the
        # statement, so a process an hour ahead sees every lease expired and reclaims it (the checker finds
        # the capacity overrun). Processes that share a SQLite file share one machine's clock, short of an
        # LD_PRELOAD like this one; docs/faults.md says so.
        pytest.skip("SQLite's clock is each process's own: skew between processes is out of its model")
    _require_faketime(skew)
    skewed, plain = run.services({"skew": skew}, {})
    run.worker(skewed.url)
    run.worker(plain.url)
    run.worker(db_url)
    run.wait_for(lambda: run.acquired() >= 3, what="the first grants")
    caught = _kill_a_holder(run, skewed.url)
    run.sleep(1.0)
    history = run.history()
    report = run.finish()
    _assert_clean(run, report)
    assert caught, "the victim was not killed while holding a lease"
    skewed_procs = {p for p, url in run.urls.items() if url == skewed.url}
    grants = [o for o in history.of("acquire") if o.outcome == OK and o.proc in skewed_procs]
    assert grants
    for grant in grants:
        assert grant["ttl_db"] == pytest.approx(run.ttl, abs=0.01), grant
        # the harness's monotonic time and wall clock advance together; the grant is stamped by the database
        age = time.time() - (time.monotonic() - grant.t1) - datetime.fromisoformat(grant["acquired_at"]).timestamp()
        assert abs(age) < 30, f"a lease granted through the skewed instance is stamped {age:.0f} s off"


def _require_faketime(skew: str) -> None:
    """libfaketime is installed and really moves a Python process's wall clock by ``skew`` (``+1h``, ``-1h``)."""
    if not Path(LIBFAKETIME).exists():
        if IN_CI:
            pytest.fail(f"{LIBFAKETIME} missing (apt-get install faketime)", pytrace=False)
        pytest.skip("libfaketime is not installed (apt-get install faketime)")
    env = {**os.environ, "LD_PRELOAD": LIBFAKETIME, "FAKETIME": skew, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    out = subprocess.run(
        [sys.executable, "-c", "import time; print(time.time())"], env=env, capture_output=True, text=True, check=True
    )
    moved = float(out.stdout) - datetime.now(UTC).timestamp()
    wanted = 3600 if skew == "+1h" else -3600
    assert abs(moved - wanted) < 100, f"libfaketime moved the clock by {moved:.0f} s, not {skew}"
