"""Where a SQLite write transaction's time goes, when ``--clients`` processes acquire and release one hot
semaphore (capacity 10) through the library for ``--seconds``.

    python benchmarks/sqlite_turn.py --clients 1,4 --seconds 4

Each process times its own transactions with ``time.perf_counter`` around the steps of
``stores/direct.py`` (the pool's checkout, ``BEGIN IMMEDIATE``, each named statement, the commit) and
around the write line's turn. SQLite lets one writer in at a time, so a transaction's time from its
``BEGIN IMMEDIATE`` to the end of its commit is the part of the cycle that no other process can overlap;
``turn`` is the whole span the write line holds, and ``in line`` the wait for it. Means in microseconds,
over every process's transactions.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import permits
from permits.stores import direct, host_lines

Totals = dict[str, list[float]]  # step -> [seconds, count]


def _instrument(totals: Totals) -> None:
    """Wrap the SQLite store's steps so that each adds its time to ``totals``."""

    def timed(step: Callable[[Any], str | None], method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args)
            finally:
                name = step(args)
                if name is not None:
                    entry = totals.setdefault(name, [0.0, 0])
                    entry[0] += time.perf_counter() - started
                    entry[1] += 1

        return wrapper

    def call_step(args: Any) -> str | None:
        method = args[1]
        name = getattr(method, "__name__", "")
        if name == "_execute":
            return f"statement {args[3].name}"
        if name == "execute":
            return str(args[2])  # BEGIN or BEGIN IMMEDIATE
        return {"commit": "commit", "raw_connection": "pool checkout"}.get(name)

    direct.DirectTransactions._call = timed(call_step, direct.DirectTransactions._call)
    direct.DirectTransactions._run = timed(lambda _: "transaction", direct.DirectTransactions._run)
    enter = host_lines.HostLines._enter
    host_lines.HostLines._enter = timed(lambda args: "in line" if args[2] == host_lines.WRITE_LINE else None, enter)
    turn = host_lines.HostLines.turn

    def timed_turn(self: host_lines.HostLines, line: int, patience: float) -> Any:
        if line != host_lines.WRITE_LINE:
            return turn(self, line, patience)
        return _TimedTurn(turn(self, line, patience), totals)

    host_lines.HostLines.turn = timed_turn


class _TimedTurn:
    """A write-line turn, timed from when it was had to when it was handed on."""

    def __init__(self, inner: Any, totals: Totals) -> None:
        self._inner, self._totals, self._had = inner, totals, 0.0

    def __enter__(self) -> bool:
        had: bool = self._inner.__enter__()
        self._had = time.perf_counter()
        return had

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self._inner.__exit__(*exc)
        finally:
            entry = self._totals.setdefault("turn", [0.0, 0])
            entry[0] += time.perf_counter() - self._had
            entry[1] += 1


def _client(url: str, seconds: float, start: Any, results: Any) -> None:
    totals: Totals = {}
    _instrument(totals)
    with permits.connect(url) as client:
        client.get_semaphore("hot")
        totals.clear()
        start.wait()
        cycles, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            client.release(client.acquire("hot", ttl=60, timeout=10))
            cycles += 1
    results.put((cycles, totals))


def measure(clients: int, seconds: float) -> tuple[float, Totals]:
    """Cycles per second and the summed step times of ``clients`` processes on a fresh database."""
    with tempfile.TemporaryDirectory(prefix="permits-turn-") as folder:
        url = f"sqlite:///{Path(folder) / 'turn.db'}"
        with permits.connect(url, auto_upgrade=True) as admin:
            admin.create_semaphore("hot", 10)
        context = multiprocessing.get_context("fork")
        start, results = context.Event(), context.Queue()
        processes = [context.Process(target=_client, args=(url, seconds, start, results)) for _ in range(clients)]
        for process in processes:
            process.start()
        time.sleep(1.0)  # every process connected
        start.set()
        reports = [results.get(timeout=seconds + 60) for _ in processes]
        for process in processes:
            process.join()
    totals: Totals = collections.defaultdict(lambda: [0.0, 0])
    for _, steps in reports:
        for step, (spent, count) in steps.items():
            totals[step][0] += spent
            totals[step][1] += count
    return sum(cycles for cycles, _ in reports) / seconds, dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,4", help="comma-separated process counts")
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    for clients in [int(c) for c in args.clients.split(",")]:
        rate, totals = measure(clients, args.seconds)
        print(f"{clients} clients: {rate:.0f} cycles/s; mean microseconds per step:")
        for step, (spent, count) in sorted(totals.items(), key=lambda item: -item[1][0]):
            print(f"  {step:<32} {spent / count * 1e6:8.1f}  ({count} times)")


if __name__ == "__main__":
    main()
