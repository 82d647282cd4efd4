"""PgBouncer SIGKILLed and started again under load, in transaction mode (docs/deployment.md, "Poolers").

A pooler's death drops every client connection and every server connection at once, commits in flight
included: PostgreSQL rolls back what was not committed, and the client cannot tell which side of the
commit its last statement was on. Workers on the library and through a ``permits serve`` instance, all
through the pooler, keep going (their operations in flight end ``unknown`` and are retried with the same
key), and afterwards the checker reads the database back, directly: every acknowledged grant is there with
its token, every acknowledged release left its lease released, every acknowledged register write is in the
register's log, no key was granted twice, and reconcile finds no drift.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tests._pgbouncer import PgBouncer
from tests.faults.harness import FaultRun, describe

pytestmark = pytest.mark.slow


def test_pooler_killed_and_restarted_under_load(servers: Any, tmp_path: Path) -> None:
    db_url = servers.url_for("postgresql").render_as_string(hide_password=False)
    with PgBouncer("transaction") as bouncer:
        pooled = bouncer.url_for(db_url.rsplit("/", 1)[1], pooler="transaction")
        run = FaultRun(tmp_path, db_url, f"t{uuid.uuid4().hex[:10]}-", ttl=3.0)
        try:
            svc = run.service(pooled)
            run.workers(2, pooled)
            run.workers(2, svc.url)
            run.wait_for(lambda: run.acquired() >= 4, what="the first grants")
            for _ in range(3):
                run.rec.event("pooler_kill")
                bouncer.kill()
                bouncer.start()
                run.progress(3, timeout=90)
            report = run.finish()
        finally:
            run.close()
        print(report)
        assert not report.violations, describe(report, run) + f"\n--- pgbouncer log\n{bouncer.log_tail()}"
