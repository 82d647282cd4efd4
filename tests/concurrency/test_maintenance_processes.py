"""The maintenance sweep of several ``permits serve`` processes on one database, through a backlog that
takes many runs: each run is elected by a lease and ends inside it, so no two instances sweep at once;
the runs are shared out among the instances; every expired lease is ended once, by exactly one run; and a
run cut by its bound says so. Each test has a database of its own, so the sweep's counts are the
backlog's alone."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

import permits
from tests._service import Service
from tests.conftest import own_database, sqlalchemy_url

BACKLOG = 3000
INSTANCES = 3
#: Each run starts no batch after 0.002 x its lease's 30 s (60 ms): the backlog takes many runs.
SHARE = "0.002"
CONFIG = """
[maintenance]
sweep_interval = 0.2
sweep_batch = 5
"""

_MAINTENANCE_LEASES = """
    SELECT l.lease_key, l.acquired_at_ms, l.ended_at_ms, l.end_reason
    FROM permits_lease l JOIN permits_permit p ON p.lease_id = l.id
    JOIN permits_semaphore s ON s.id = p.semaphore_id
    WHERE s.name = 'permits:maintenance:sweep' ORDER BY l.acquired_at_ms, l.id"""


@pytest.fixture(params=["sqlite", "mysql", "postgresql"])
def fresh_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'permits.db'}"
        return
    with own_database(request.param, "permits_sweeps") as url:
        yield url


def _sweep_runs(service: Service) -> list[dict[str, Any]]:
    """The instance's log lines for runs of the sweep task (JSON), in order."""
    runs = []
    for line in service.output:
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("logger") == "permits.maintenance" and entry.get("task") == "sweep":
                runs.append(entry)
    return runs


def test_instances_share_a_backlog_out_in_runs_that_never_overlap(fresh_db: str, tmp_path: Path) -> None:
    with permits.connect(fresh_db, auto_upgrade=True) as client:
        client.list_semaphores()  # the schema, before the instances start
    config = tmp_path / "permits.toml"
    config.write_text(CONFIG)
    services: list[Service] = []
    engine = create_engine(sqlalchemy_url(fresh_db))
    try:
        for _ in range(INSTANCES):
            services.append(
                Service.started(
                    fresh_db,
                    module="tests._short_sweeps",
                    env={"PERMITS_TEST_SWEEP_SHARE": SHARE},
                    args=("--config", str(config), "--log-format", "json", "--log-level", "debug"),
                )
            )
        # The backlog, with every instance running: its leases expire while the rest are granted.
        with permits.connect(fresh_db, owner="backlog") as client:
            client.create_semaphore("jobs", BACKLOG)
            for i in range(BACKLOG):
                client.acquire("jobs", key=f"job-{i}", ttl=0.5)
        deadline = time.monotonic() + 120
        held = BACKLOG
        while held and time.monotonic() < deadline:
            time.sleep(0.5)
            with engine.connect() as conn:
                held = conn.execute(text("SELECT COUNT(*) FROM permits_lease WHERE owner = 'backlog' AND state = 1"))
                held = held.scalar()
        assert held == 0, f"{held} expired leases still held after 120 s"
    finally:
        for service in services:
            service.stop()
    with engine.connect() as conn:
        reasons = dict(
            conn.execute(
                text("SELECT end_reason, COUNT(*) FROM permits_lease WHERE owner = 'backlog' GROUP BY end_reason")
            ).all()
        )
        elected = conn.execute(text(_MAINTENANCE_LEASES)).all()
    engine.dispose()
    assert reasons == {"swept": BACKLOG}, reasons

    runs = {i: [r for r in _sweep_runs(s) if r["outcome"] == "done"] for i, s in enumerate(services)}
    logs = "\n".join(s.log() for s in services)
    assert all(r["outcome"] != "failed" for s in services for r in _sweep_runs(s)), logs
    # Every expired lease was counted by exactly one run: none twice, none missed.
    assert sum(r["leases"] for rs in runs.values() for r in rs) == BACKLOG, runs
    sweeping = [i for i, rs in runs.items() if any(r["leases"] for r in rs)]
    assert len(sweeping) >= 2, f"one instance did every run: {runs}"
    assert any(r.get("complete") is False for rs in runs.values() for r in rs), "no run was cut by its bound"
    assert all(r["seconds"] < 30 for rs in runs.values() for r in rs)

    # The runs' leases (on the database's clock): each ended by its own release, inside its TTL, before the
    # next was granted; as many as the runs the instances logged.
    assert len(elected) == sum(len(rs) for rs in runs.values()), (len(elected), runs)
    for (_, _, ended, reason), (_, following, _, _) in itertools.pairwise(elected):
        assert reason == "released" and ended is not None and ended <= following, elected
    assert elected[-1][3] == "released", elected[-1]
