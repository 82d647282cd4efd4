"""The fault suite's checker on a 3-node Galera cluster, with every node serving acquires: workers on the
library against each node and through a ``permits serve`` instance on each node write to the fenced
register; a holder is SIGKILLed; then a node is SIGKILLed under load, and rejoins.

The checker (tests/faults/checker.py) reads every recorded operation and the database at the end: no
instant with more definitely-held leases than capacity, tokens increasing in real-time order, the register
never accepting a token out of order, no key granted twice, a killed holder's permits back within ttl +
sweep, every acknowledged grant and release still in the database (read through the node that was
down), and no drift.

About 90 s on two cores.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests._galera import GaleraCluster
from tests.faults.harness import FaultRun, describe

pytestmark = pytest.mark.slow


def test_the_checker_finds_nothing_with_three_nodes_serving_and_one_killed(
    galera: GaleraCluster, tmp_path: Path
) -> None:
    urls = [galera.url(i) for i in range(3)]
    # The harness reads the final state through node 2, the node that will be killed and rejoin.
    run = FaultRun(tmp_path, urls[2], f"g{uuid.uuid4().hex[:8]}-", ttl=3.0)
    try:
        services = run.services(*({"db_url": url} for url in urls))
        for url in urls:
            run.workers(1, url)
        for svc in services:
            run.workers(1, svc.url)
        run.wait_for(lambda: run.acquired() >= 6, what="the first grants")
        holder = next(iter(run.procs))
        run.kill_worker(holder)
        run.progress(4, timeout=60)
        run.rec.event("galera_node_kill", node=2)
        galera.kill(2)
        galera.wait_synced(0, timeout=60, size=2)
        run.progress(4, timeout=90)
        run.rec.event("galera_node_restart", node=2)
        galera.restart(2)
        run.progress(4, timeout=90)
        report = run.finish()
    finally:
        run.close()
    print(report)
    assert not report.violations, describe(report, run) + "\n--- galera\n" + galera.logs()
