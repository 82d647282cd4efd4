"""The database server restarts, or is SIGKILLed and started again (crash recovery), under load.

Each engine gets a private server (``tests/_private_db.py``): the shared servers are never touched. Workers
on the library and through a ``permits serve`` instance keep going through the outage (their operations
in flight end ``unknown`` and are retried with the same key), and afterwards the checker reads the
database back: every acknowledged grant is there with its token, every acknowledged release left its lease
released, every acknowledged register write is in the register's log, and reconcile finds no drift. The
servers keep their durable defaults (fsync on; innodb_flush_log_at_trx_commit=1).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests._private_db import PrivateServer
from tests.faults.harness import FaultRun, describe

pytestmark = pytest.mark.slow


@pytest.fixture(params=["mariadb", "postgresql"])
def server(request: pytest.FixtureRequest) -> PrivateServer:
    server: PrivateServer = request.getfixturevalue(f"private_{request.param}")
    return server


@pytest.mark.parametrize("fault", ["restart", "kill"])
def test_database_outage_under_load(server: PrivateServer, fault: str, tmp_path: Path) -> None:
    run = FaultRun(tmp_path, server.url, f"t{uuid.uuid4().hex[:10]}-", ttl=3.0)
    try:
        svc = run.service()
        run.workers(2, server.url)
        run.workers(2, svc.url)
        run.wait_for(lambda: run.acquired() >= 4, what="the first grants")
        for _ in range(2):
            run.rec.event(f"database_{fault}")
            if fault == "restart":
                server.restart()
            else:
                server.kill()
                server.start()
            run.rec.event(f"database_{fault}_end")
            run.progress(3, timeout=90)
        report = run.finish()
        history = run.history()
    finally:
        run.close()
    print(report)
    assert not report.violations, describe(report, run) + f"\n--- {server.kind} log\n{server.log_tail()}"
    # The clean report is about work the outages hit (History.held_up).
    kind = f"database_{fault}"
    assert history.held_up(kind), [(o.op, o.outcome, round(o.t1 - o.t0, 2)) for o in history.met(kind)]
