"""What one statement costs through psycopg's sync connection and through its asyncio one, with its round
trip, as the SQL store sends a statement that runs alone: autocommit switched on, the statement prepared,
its rows read, autocommit switched off. The statement reads nothing (``SELECT`` of its parameter), so the
figures are the driver's and the round trip's, not the server's work.

    python benchmarks/pg_driver_cost.py postgresql://postgres@127.0.0.1:5432/permits_bench --statements 5000

The two run in turn, ``--rounds`` times, each after an uncounted warm-up. Behind "Through the service at
one client" in docs/benchmarks.md: whether the service's asyncio driver is what makes its requests cost
more than the library's.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import psycopg

STATEMENT = "SELECT CAST(%s AS TEXT)"
WARMUP = 300


def sync_cost(url: str, statements: int) -> float:
    """Seconds per statement on a sync connection."""
    with psycopg.connect(url, autocommit=True) as conn:
        for _ in range(WARMUP):
            conn.execute(STATEMENT, ("hot",), prepare=True).fetchall()
        conn.autocommit = False
        started = time.perf_counter()
        for _ in range(statements):
            conn.autocommit = True
            conn.execute(STATEMENT, ("hot",), prepare=True).fetchall()
            conn.autocommit = False
        return (time.perf_counter() - started) / statements


async def async_cost(url: str, statements: int) -> float:
    """Seconds per statement on an asyncio connection."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for _ in range(WARMUP):
            await (await conn.execute(STATEMENT, ("hot",), prepare=True)).fetchall()
        await conn.set_autocommit(False)
        started = time.perf_counter()
        for _ in range(statements):
            await conn.set_autocommit(True)
            await (await conn.execute(STATEMENT, ("hot",), prepare=True)).fetchall()
            await conn.set_autocommit(False)
        return (time.perf_counter() - started) / statements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="a PostgreSQL URL (postgresql://user@host:port/db)")
    parser.add_argument("--statements", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.rounds):
        sync = sync_cost(args.url, args.statements)
        asynchronous = asyncio.run(async_cost(args.url, args.statements))
        print(f"sync {sync * 1e6:.0f} us  asyncio {asynchronous * 1e6:.0f} us  a statement, with its round trip")


if __name__ == "__main__":
    main()
