"""An experiment, not permits: the design last measured as the lead for a hot PostgreSQL semaphore
(docs/benchmarks.md, "Releases on a row of their own, waiters queued on the semaphore's row lock").

Releases count returns on a row of their own (``rq_returns``), so they never wait for the semaphore's row.
An acquire is one call of a PL/pgSQL function that locks the semaphore's row (acquirers queue there, in
PostgreSQL's lock queue, at no cost while they wait), reads the returns with a fresh snapshot (a stale
read could only undercount room), and takes a permit if ``used - returned`` leaves room. Refused, the
client asks again at once: it joins the tail of the queue.

Only what a grant and a release need is here: no expiry, sweep, fair mode or waiting policy.

    cd benchmarks && python harness.py --system floor,seed,systems:PERMITS,row_queue:ROW_QUEUE \
        --backend postgresql --scenario hot --clients 1,4,16,64 --seconds 5 --warmup 1
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from harness import Scenario

DDL = [
    "DROP TABLE IF EXISTS rq_sem, rq_returns, rq_lease",
    "CREATE TABLE rq_sem (name text PRIMARY KEY, capacity bigint NOT NULL, used bigint NOT NULL DEFAULT 0,"
    " last_token bigint NOT NULL DEFAULT 0)",
    "CREATE TABLE rq_returns (name text PRIMARY KEY, returned bigint NOT NULL DEFAULT 0)",
    "CREATE TABLE rq_lease (id bigserial PRIMARY KEY, owner text NOT NULL, key text NOT NULL, sem text NOT NULL,"
    " token bigint NOT NULL, state smallint NOT NULL, acquired_ms bigint NOT NULL, expires_ms bigint NOT NULL,"
    " ended_ms bigint, UNIQUE (owner, key))",
    """CREATE OR REPLACE FUNCTION rq_acquire(p_owner text, p_key text, p_name text, p_ttl bigint) RETURNS bigint
    LANGUAGE plpgsql AS $f$
    DECLARE cap bigint; u bigint; r bigint; tok bigint; now_ms bigint;
    BEGIN
      SELECT capacity, used INTO cap, u FROM rq_sem WHERE name = p_name FOR UPDATE;
      SELECT returned INTO r FROM rq_returns WHERE name = p_name;
      IF u - r + 1 > cap THEN RETURN NULL; END IF;
      UPDATE rq_sem SET used = used + 1, last_token = last_token + 1 WHERE name = p_name RETURNING last_token INTO tok;
      now_ms := CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS bigint);
      INSERT INTO rq_lease (owner, key, sem, token, state, acquired_ms, expires_ms)
      VALUES (p_owner, p_key, p_name, tok, 1, now_ms, now_ms + p_ttl);
      RETURN tok;
    END $f$""",
]
RELEASE = """
    WITH e AS (
        UPDATE rq_lease SET state = 0, ended_ms = CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000 AS bigint)
        WHERE owner = %s AND key = %s AND state = 1 RETURNING sem)
    UPDATE rq_returns r SET returned = returned + 1 FROM e WHERE r.name = e.sem"""


def _conn(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True, prepare_threshold=0)


class RowQueueSystem:
    name = "row-queue"

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        with _conn(backend_url) as conn:
            for stmt in DDL:
                conn.execute(stmt)
            for name in scenario.all_semaphores():
                conn.execute("INSERT INTO rq_sem (name, capacity) VALUES (%s, %s)", (name, scenario.capacity))
                conn.execute("INSERT INTO rq_returns (name) VALUES (%s)", (name,))

    def load_history(self, backend_url: str, scenario: Scenario, rows: int) -> None:
        raise NotImplementedError("the experiment measures an empty history only")

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> RowQueueClient:
        return RowQueueClient(backend_url, scenario.semaphores_for(client_index))

    def verify(self, backend_url: str, scenario: Scenario) -> list[str]:
        with _conn(backend_url) as conn:
            rows = conn.execute(
                "SELECT s.name, s.used - r.returned,"
                " (SELECT count(*) FROM rq_lease l WHERE l.sem = s.name AND state = 1)"
                " FROM rq_sem s JOIN rq_returns r USING (name)"
            ).fetchall()
        return [f"{n}: in use {u}, held {h}" for n, u, h in rows if u != 0 or h != 0]


class RowQueueClient:
    def __init__(self, url: str, names: Sequence[str]) -> None:
        (self._name,) = names  # one semaphore per acquire: the hot and spread scenarios
        self._conn = _conn(url)
        self._owner = uuid.uuid4().hex[:8]

    def cycle(self) -> bool:
        key = uuid.uuid4().hex
        row = self._conn.execute("SELECT rq_acquire(%s, %s, %s, %s)", (self._owner, key, self._name, 60000)).fetchone()
        if row is None or row[0] is None:
            return False
        self._conn.execute(RELEASE, (self._owner, key))
        return True

    def close(self) -> None:
        self._conn.close()


ROW_QUEUE = RowQueueSystem()
