"""Does a long history cost a SQLite acquire anything? One client on a semaphore of its own (the spread
scenario), on two database files made the same way but for ``--rows`` old released leases in one of them.

    python benchmarks/sqlite_history.py --rows 1000000 --rounds 6 --seconds 5

Two readings, for each file:

- **loop steps per cycle, by statement.** SQLite calls a progress handler at its virtual machine's jumps,
  so the count grows with every row a statement visits in a loop: a statement that scanned the history
  would show it there, whatever the machine's speed. A B-tree seek is one step however deep the tree, so
  equal counts mean equal plans, and that any cost left is in the pages the seeks touch.
- **cycles per second, rounds alternating** between the two files (each round opens a fresh client, warms
  up for a second and then counts ``--seconds``), with the client process's CPU per cycle. One round is
  noisy on a shared VM; the rounds together say whether the history costs anything above that noise.
"""

from __future__ import annotations

import argparse
import collections
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import Scenario
from systems import PermitsSystem

from permits.stores import direct

SCENARIO = Scenario("spread", 1)


def _count_loop_steps(steps: collections.Counter[str]) -> Callable[[], None]:
    """From now on every new SQLite connection adds its loop steps to ``steps``, under the name of the
    statement that ran them (``BEGIN``, ``COMMIT`` or the store's name for it). Returns the undo."""
    current = ["-"]
    connect = sqlite3.dbapi2.connect
    call = direct.DirectTransactions._call

    def counting_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        connection = connect(*args, **kwargs)

        def step() -> int:
            steps[current[0]] += 1
            return 0  # go on

        connection.set_progress_handler(step, 1)
        return connection

    def naming_call(self: Any, method: Callable[..., Any], *args: Any) -> Any:
        name = getattr(method, "__name__", "")
        if name == "_execute":
            current[0] = args[1].name
        elif name == "execute":
            current[0] = str(args[0])
        else:
            current[0] = name
        return call(self, method, *args)

    sqlite3.dbapi2.connect = counting_connect  # SQLAlchemy's pysqlite dialect connects through dbapi2
    direct.DirectTransactions._call = naming_call  # type: ignore[method-assign]

    def undo() -> None:
        sqlite3.dbapi2.connect = connect
        direct.DirectTransactions._call = call  # type: ignore[method-assign]

    return undo


def _prepare(path: Path, rows: int) -> tuple[PermitsSystem, str]:
    url = f"sqlite:///{path}"
    system = PermitsSystem()
    system.setup(url, SCENARIO)
    if rows:
        system.load_history(url, SCENARIO, rows)
    return system, url


def loop_steps(system: PermitsSystem, url: str, cycles: int) -> collections.Counter[str]:
    """Loop steps per cycle by statement, over ``cycles`` cycles after as many uncounted."""
    steps: collections.Counter[str] = collections.Counter()
    undo = _count_loop_steps(steps)
    try:
        client = system.make_client(url, SCENARIO, 0)
        try:
            for _ in range(cycles):
                client.cycle()
            steps.clear()
            for _ in range(cycles):
                client.cycle()
        finally:
            client.close()
    finally:
        undo()
    return collections.Counter({name: count // cycles for name, count in steps.items()})


def rate(system: PermitsSystem, url: str, seconds: float) -> tuple[float, float]:
    """Cycles per second over ``seconds`` after one second of warm-up, and the CPU ms per cycle."""
    client = system.make_client(url, SCENARIO, 0)
    try:
        started = time.perf_counter()
        while time.perf_counter() - started < 1:
            client.cycle()
        cycles, cpu, started = 0, time.process_time(), time.perf_counter()
        while time.perf_counter() - started < seconds:
            client.cycle()
            cycles += 1
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        client.close()
    return cycles / elapsed, cpu / cycles * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="old released leases in the second file")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--cycles", type=int, default=1000, help="cycles whose loop steps are counted")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        files = {rows: _prepare(Path(directory) / f"history-{rows}.db", rows) for rows in (0, args.rows)}
        for rows, (system, url) in files.items():
            steps = loop_steps(system, url, args.cycles)
            detail = ", ".join(f"{name} {count}" for name, count in steps.most_common() if count)
            print(f"{rows:>9} old rows: {sum(steps.values())} loop steps a cycle ({detail})")
        changes = []
        for round_number in range(1, args.rounds + 1):
            (empty, empty_ms), (full, full_ms) = (rate(*files[rows], args.seconds) for rows in (0, args.rows))
            changes.append(full / empty - 1)
            print(
                f"round {round_number}: empty {empty:,.0f} cycles/s ({empty_ms:.3f} CPU ms a cycle),"
                f" {args.rows:,} old rows {full:,.0f} ({full_ms:.3f}): {changes[-1]:+.0%}",
                flush=True,
            )
        print(f"mean change {sum(changes) / len(changes):+.1%}, from {min(changes):+.0%} to {max(changes):+.0%}")


if __name__ == "__main__":
    main()
