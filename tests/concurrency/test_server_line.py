"""On PostgreSQL, waiters for one plain semaphore take their turns in the server's lock queue (the queued
grant, dialects/pg_functions.py; the policy, permits/_pacing.py). Real processes, a real server.

- On a busy mutex and on a hot semaphore every process gets about equal turns, none times out, and the
  grants go through the line. (For holds up to about ``LINE_HEAD_WAIT_SECONDS``: waiters for longer ones
  leave the line, and plain semaphores promise no order. Fair semaphores do: test_fair_queue_processes.py.)
- A waiter for a permit that is held for long does not spin through the line: its attempts stay few.
"""

from __future__ import annotations

import pytest

import permits
from permits._pacing import IN_LINE_TRIES
from tests._children import run_take_turns
from tests.conftest import count_function_calls, function_calls, own_database

pytestmark = [pytest.mark.usefixtures("servers"), pytest.mark.slow]


def _jain(turns: list[int]) -> float:
    return sum(turns) ** 2 / (len(turns) * sum(t * t for t in turns))


@pytest.mark.parametrize(("capacity", "hold"), [(1, 0.02), (2, 0.0)], ids=["mutex-held-20ms", "hot"])
def test_processes_take_even_turns_through_the_servers_line(ns: str, capacity: int, hold: float) -> None:
    """Without the line both cases starved processes: one of six took 162 of 168 turns on the mutex, and
    twelve processes on the hot semaphore had a Jain index of 0.77."""
    with own_database("postgresql", "permits_line") as url:
        count_function_calls(url)
        with permits.connect(url, auto_upgrade=True) as admin:
            admin.create_semaphore(f"{ns}m", capacity)
            processes = 6 if capacity == 1 else 12
            args = {"url": url, "name": f"{ns}m", "seconds": 4, "hold": hold, "timeout": 5}
            results = run_take_turns(processes, args)
            assert admin.get_semaphore(f"{ns}m").used == 0
            assert admin.reconcile() == []
        calls = function_calls(url)
    turns = [r["granted"] for r in results]
    assert all(r["timed_out"] == 0 for r in results), results
    assert _jain(turns) >= 0.9, (_jain(turns), results)
    # Every attempt of a waiting acquire of one semaphore went through the line (the children count the
    # statements they send, the server the calls of the queued grant), and the line paced them: most
    # turns found room, at once or at the head of the line.
    attempts = sum(r["attempts"] for r in results)
    assert calls.get("acquire_one_queued", 0) >= attempts, (calls, results)
    assert attempts / sum(turns) <= 1.5, (attempts / sum(turns), results)


def test_a_waiter_for_a_permit_held_all_along_asks_only_a_few_times(ns: str) -> None:
    """Each attempt in the line waits at its head for a while; without the bound on refusals there, each
    process here would ask about twenty times a second."""
    with own_database("postgresql", "permits_line") as url:
        count_function_calls(url)
        with permits.connect(url, auto_upgrade=True) as admin:
            admin.create_semaphore(f"{ns}m", 1)
            held = admin.acquire(f"{ns}m", ttl=60)
            args = {"url": url, "name": f"{ns}m", "seconds": 3, "hold": 0, "timeout": 2}
            results = run_take_turns(4, args)
            admin.release(held)
            assert admin.get_semaphore(f"{ns}m").used == 0
        calls = function_calls(url)
    assert all(r["granted"] == 0 and r["timed_out"] == 2 for r in results), results
    # Two acquires of 2 s each: IN_LINE_TRIES in the line each, then a backoff that reaches a second.
    for result in results:
        assert result["attempts"] <= 2 * (IN_LINE_TRIES + 8), results
    # (and one more: the acquire that took the permit)
    assert calls.get("acquire_one_queued", 0) == 4 * 2 * IN_LINE_TRIES + 1, calls
