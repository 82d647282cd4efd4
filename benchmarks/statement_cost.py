"""What permits' own SQL costs on PostgreSQL, without the library: its one-statement grant and release
(``ACQUIRE_ONE``, ``RELEASE_ONE``) sent on one psycopg connection in autocommit, beside the floor's two
conditional UPDATEs on the same connection.

    python benchmarks/statement_cost.py postgresql://postgres@127.0.0.1:5432/permits_bench --cycles 3000

The gap between the two lines is what the statements themselves cost (the lease and permit rows, their
indexes, the larger commit); the gap between the permits line and ``client_cpu.py``'s wall time per cycle
is what the library adds. A third line sends the same statements unprepared, as the library does behind
a transaction pooler would without its server functions: the gap to the second is parsing and planning
them anew. A fourth calls the server functions made from them (``permits.dialects.pg_functions``),
unprepared, as the library does behind a transaction pooler (``?pooler=transaction``): PL/pgSQL keeps the
plans of their statements in the session. The "queued grant" line sends the grant of a waiting acquire,
which first waits for its turn in the server's lock queue (the function ``ACQUIRE_ONE_QUEUED``, prepared,
as the library sends it straight to the server), with the plain release. Each variant runs ``--rounds``
times, alternating, after an uncounted warm-up.
The tables are dropped and created again first, on the database the URL names.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable

import psycopg
from sqlalchemy import text
from sqlalchemy.dialects.postgresql.psycopg import dialect as psycopg_dialect
from systems import _reset

import permits
from permits.dialects.pg_functions import POOLED_FUNCTIONS, server_functions
from permits.dialects.postgresql import PostgreSQL

FLOOR_TAKE = "UPDATE permits_semaphore SET used = used + 1 WHERE name = 'floor' AND used + 1 <= capacity"
FLOOR_GIVE = "UPDATE permits_semaphore SET used = used - 1 WHERE name = 'floor'"


def _grant_params(key: str) -> dict[str, object]:
    """The parameters of one grant of one permit of the benchmark's semaphore, as the library sends them."""
    return {
        "owner": "cost",
        "key": key,
        "name": "permits",
        "count": 1,
        "ttl_ms": 60000,
        "request_id": None,
        "lock_wait_ms": None,
    }


def _as_sent(dialect: PostgreSQL, name: str) -> str:
    """A statement compiled for psycopg as the store compiles it (``_driver_sql``): the exact text the
    library sends."""
    return str(dialect.clause(name).compile(dialect=psycopg_dialect()))


def _as_called(call: str) -> str:
    """A function call with the store's bound parameters, compiled for psycopg as the store compiles it."""
    return str(text(call).compile(dialect=psycopg_dialect()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="a PostgreSQL URL (postgresql://user@host:port/database)")
    parser.add_argument("--cycles", type=int, default=3000, help="cycles per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="measurements per variant, alternating")
    args = parser.parse_args()
    _reset(args.url)
    with permits.connect(args.url, auto_upgrade=True) as client:
        client.create_semaphore("permits", 10)
        client.create_semaphore("floor", 10)
    dialect = PostgreSQL()
    acquire, release = (_as_sent(dialect, name) for name in ("ACQUIRE_ONE", "RELEASE_ONE"))
    # prepare_threshold=0: every statement is prepared on the server from its first use, as psycopg does
    # for the library's statements after five.
    libpq = args.url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(libpq, autocommit=True, prepare_threshold=0) as conn:
        cur = conn.cursor()

        def floor_cycle() -> None:
            cur.execute(FLOOR_TAKE)
            cur.execute(FLOOR_GIVE)

        def prepared(grant: str, give_back: str, **more: int) -> Callable[[], None]:
            """A cycle that sends ``grant`` (with ``more`` parameters) and ``give_back`` prepared, as the
            library does straight to the server."""

            def cycle() -> None:
                key = uuid.uuid4().hex
                cur.execute(grant, {**_grant_params(key), **more})
                if len(cur.fetchall()) != 1:
                    raise SystemExit("the grant granted nothing: is another client using this database?")
                cur.execute(give_back, {"owner": "cost", "key": key})
                cur.fetchall()

            return cycle

        def unprepared(grant: str, give_back: str) -> Callable[[], None]:
            """A cycle that sends ``grant`` and ``give_back`` unprepared, as behind a transaction pooler."""

            def cycle() -> None:
                key = uuid.uuid4().hex
                if len(conn.execute(grant, _grant_params(key), prepare=False).fetchall()) != 1:
                    raise SystemExit("the grant granted nothing: is another client using this database?")
                conn.execute(give_back, {"owner": "cost", "key": key}, prepare=False).fetchall()

            return cycle

        functions = {f.statement: f for f in server_functions(dialect, POOLED_FUNCTIONS)}
        for function in functions.values():  # made as the library makes them, where missing
            if conn.execute("SELECT to_regprocedure(%s)", (function.signature,)).fetchone() == (None,):
                conn.execute(function.definition, prepare=False)
        grant_call, release_call, queued_call = (
            _as_called(functions[name].call) for name in ("ACQUIRE_ONE", "RELEASE_ONE", "ACQUIRE_ONE_QUEUED")
        )

        variants: dict[str, Callable[[], None]] = {
            "floor": floor_cycle,
            "permits statements": prepared(acquire, release),
            "queued grant": prepared(queued_call, release, wait_ms=5000, head_ms=50),
            "unprepared": unprepared(acquire, release),
            "server functions": unprepared(grant_call, release_call),
        }
        for cycle in variants.values():
            for _ in range(args.cycles // 4):
                cycle()
        for _ in range(args.rounds):
            for label, cycle in variants.items():
                started = time.perf_counter()
                for _ in range(args.cycles):
                    cycle()
                elapsed = time.perf_counter() - started
                print(f"{label:20s} {elapsed / args.cycles * 1000:.3f} ms/cycle")


if __name__ == "__main__":
    main()
