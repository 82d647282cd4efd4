"""Six processes take turns on a fair mutex, directly on MariaDB: none times out, and each gets an about
equal share (a fair queue serves its waiters in arrival order).

MariaDB only: on PostgreSQL and SQLite the same run (six processes, a fair mutex held 20 ms) is the
``mutex-held-20ms-fair`` case of tests/concurrency/test_server_line.py (which also bounds the attempts per
grant and counts the turns through the line) and of test_sqlite_lines.py (which also bounds the longest
wait)."""

from __future__ import annotations

import pytest

import permits
from tests._children import run_take_turns

PROCESSES = 6


@pytest.mark.parametrize("backend", ["mysql"])
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
