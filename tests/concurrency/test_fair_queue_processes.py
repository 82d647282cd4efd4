"""Six processes take turns on a fair mutex, directly on each database: none times out, and each gets an
about equal share (a fair queue serves its waiters in arrival order).

On PostgreSQL a queued waiter is called on its process's own channel when its turn comes (see
permits/_async/listener.py), so each grant costs about one attempt of the waiter it goes to; a waiter that
paced itself by a prediction asked several times per grant."""

from __future__ import annotations

import permits
from tests._children import run_take_turns

PROCESSES = 6


def test_processes_take_fair_turns_on_a_mutex(db_url: str, backend: str, ns: str) -> None:
    name = f"{ns}m"
    with permits.connect(db_url) as admin:
        admin.create_semaphore(name, 1, fair=True)
        args = {"url": db_url, "name": name, "seconds": 4, "hold": 0.02, "timeout": 5}
        results = run_take_turns(PROCESSES, args)
        assert admin.get_semaphore(name).used == 0
        assert admin.waiters(name) == []
    turns = [r["granted"] for r in results]
    assert all(r["timed_out"] == 0 for r in results), results
    jain = sum(turns) ** 2 / (len(turns) * sum(t * t for t in turns))
    assert jain >= 0.9, (jain, results)
    if backend == "postgresql":
        per_grant = sum(r["attempts"] for r in results) / sum(turns)
        assert per_grant <= 2.5, (per_grant, results)
