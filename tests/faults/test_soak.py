"""The soak: a long run with a random mix of every fault, checked by the same checker, and watched for
leaks: the memory (RSS) of the service instance and of each library worker that run throughout, and the
database's connections, each both against its level after the warm-up and for a steady climb. One library
worker is spared the kills so that one lives through the whole run.

Skipped unless ``PERMITS_SOAK`` is set to the run's length in seconds (``tests/faults/conftest.py``)::

    PERMITS_SOAK=1800 .venv/bin/python -m pytest tests/faults -m soak -s

It runs on a private server (``PERMITS_SOAK_DB``: ``postgresql``, the default, or ``mariadb``), so that
it can restart and kill it, and count its connections without anyone else's.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests._private_db import PrivateServer
from tests._proxy import CuttingProxy
from tests.faults.harness import FaultRun, describe
from tests.faults.worker import sync_url

SOAK_SECONDS = float(os.environ.get("PERMITS_SOAK") or 0)
FAULTS = [
    "kill_worker",
    "pause_worker",
    "kill_service",
    "cut_link",
    "stall_link",
    "stall_link_past_ttl",
    "restart_db",
    "kill_db",
]
#: seconds between faults
PERIOD = 8.0
#: a dead instance may hold a maintenance lease (30 s TTL, see server/maintenance.py) that the sweep must
#: wait out; the slack on a killed holder's return covers it
SLACK = 45.0


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _connections(server: PrivateServer) -> int:
    engine = create_engine(sync_url(server.url))
    try:
        with engine.connect() as conn:
            if server.kind == "postgresql":
                query = "SELECT count(*) FROM pg_stat_activity WHERE datname = 'permits'"
            else:
                query = "SELECT count(*) FROM information_schema.PROCESSLIST WHERE db = 'permits'"
            return int(conn.execute(text(query)).scalar_one()) - 1  # not this one
    finally:
        engine.dispose()


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(SOAK_SECONDS + 1200)
def test_soak(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    server: PrivateServer = request.getfixturevalue(f"private_{os.environ.get('PERMITS_SOAK_DB', 'postgresql')}")
    rng = random.Random(os.environ.get("PERMITS_SOAK_SEED", "soak"))
    url = make_url(server.url)
    run = FaultRun(tmp_path, server.url, f"t{uuid.uuid4().hex[:10]}-", capacity=3, ttl=3.0, hold=0.2, slack=SLACK)
    samples: list[tuple[float, int, int]] = []  # (time, steady instance's RSS in KiB, database connections)
    worker_rss: dict[str, list[tuple[float, int]]] = {}  # library worker -> (time, RSS in KiB), while it lives
    faults: list[str] = []
    try:
        with CuttingProxy(("127.0.0.1", url.port or 0)) as proxy:
            via = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
            steady, flaky = run.services({}, {"db_url": via})
            for target in (server.url, server.url, steady.url, steady.url, flaky.url, flaky.url):
                run.worker(target)
            # One library worker is never killed (it may be paused), so that one lives through the whole run
            # to be watched for leaks: the others' replacements come and go under new names.
            sentinel = next(proc for proc, url in run.urls.items() if url == server.url)
            run.wait_for(lambda: run.acquired() >= 5, what="the first grants")
            started = time.monotonic()
            while time.monotonic() - started < SOAK_SECONDS:
                run.sleep(PERIOD)
                now = time.monotonic() - started
                samples.append((now, _rss_kib(steady.process.pid), _connections(server)))
                for proc, popen in run.procs.items():
                    if run.urls[proc] == server.url and popen.poll() is None:
                        worker_rss.setdefault(proc, []).append((now, _rss_kib(popen.pid)))
                fault = rng.choice(FAULTS)
                faults.append(fault)
                run.rec.event(fault)
                live = [p for p, popen in run.procs.items() if popen.poll() is None]
                if fault == "kill_worker":
                    victim = rng.choice([proc for proc in live if proc != sentinel])
                    run.kill_worker(victim)
                    run.worker(run.urls[victim])  # a replacement, where the victim went
                elif fault == "pause_worker":
                    pid = run.procs[rng.choice(live)].pid
                    os.kill(pid, signal.SIGSTOP)
                    run.sleep(run.ttl + 2)
                    os.kill(pid, signal.SIGCONT)
                elif fault == "kill_service":
                    run.kill_service(flaky)
                    run.sleep(1)
                    flaky = run.restart_service(flaky)
                elif fault == "cut_link":
                    proxy.cut_all()
                elif fault in ("stall_link", "stall_link_past_ttl"):
                    proxy.stall()  # past the TTL: the leases held through that instance expire meanwhile
                    run.sleep(2 if fault == "stall_link" else run.ttl * 1.5)
                    proxy.resume()
                elif fault == "restart_db":
                    server.restart()
                else:
                    server.kill()
                    server.start()
            report = run.finish()
    finally:
        run.close()
    print(report)
    print("faults:", {f: faults.count(f) for f in FAULTS})
    print("samples (s, RSS KiB, connections):", samples)
    print("library workers' RSS (s, KiB):", worker_rss)
    assert not report.violations, describe(report, run)
    _assert_flat(samples)
    assert len(worker_rss[sentinel]) == len(samples), worker_rss[sentinel]
    for proc, series in worker_rss.items():
        if len(series) >= len(samples) // 2:
            _assert_no_climb(f"RSS of {proc}", series, margin_kib=10 * 1024)


def _assert_flat(samples: list[tuple[float, int, int]]) -> None:
    """After a warm-up (the first fifth of the run), the last quarter's RSS and connections stay within a
    margin of the warm-up's: RSS by at most a tenth more and 10 MiB (allocator noise, caches that fill
    once), connections by at most 5 (pools refill after a restart at their own pace); and neither climbs
    steadily over the run (``_assert_no_climb``)."""
    assert len(samples) >= 8, f"too short a soak to judge: {len(samples)} samples"
    n = len(samples)
    warm = samples[n // 5 : n // 5 + max(2, n // 5)]
    last = samples[-max(2, n // 4) :]
    rss_warm = statistics.median(s[1] for s in warm)
    rss_last = statistics.median(s[1] for s in last)
    assert rss_last <= rss_warm * 1.10 + 10 * 1024, f"RSS grew from {rss_warm} KiB to {rss_last} KiB"
    conn_warm = max(s[2] for s in warm)
    conn_last = statistics.median(s[2] for s in last)
    assert conn_last <= conn_warm + 5, f"connections grew from {conn_warm} to {conn_last}"
    _assert_no_climb("the steady instance's RSS", [(t, rss) for t, rss, _ in samples], margin_kib=10 * 1024)


def _assert_no_climb(what: str, series: list[tuple[float, int]], margin_kib: int) -> None:
    """No steady climb after the warm-up: the least-squares slope over the rest of the run, times its
    length, stays under 1.5 times the flat check's margin (``margin_kib`` and a tenth of the level after
    the warm-up). A leak of a little per request shows as a slope however noisy the samples; a step
    (a cache that fills once) of up to that margin passes wherever it falls (a step of h half-way reads
    as 1.5 h)."""
    rest = series[len(series) // 5 :]
    if len(rest) < 4:
        return
    times, values = [t for t, _ in rest], [v for _, v in rest]
    slope = statistics.linear_regression(times, values).slope  # KiB per second
    climb = slope * (times[-1] - times[0])
    allowed = 1.5 * (margin_kib + 0.1 * statistics.median(values[: max(2, len(values) // 4)]))
    assert climb <= allowed, f"{what} climbed {climb:.0f} KiB over the run (allowed {allowed:.0f}): {series}"
