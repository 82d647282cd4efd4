"""A measurement, not a way to run permits: permits' own grant and release statements on PostgreSQL, sent
by a bare driver (docs/benchmarks.md, "PostgreSQL's floor cells: the statements without the client").

``systems.PERMITS`` pays for two things per cycle: its statements, in PostgreSQL, and its client, in
Python (validation, the decision core, the pool, the reply deadline, the lease object). The history floor
(history_floor.py) measures a design with permits' history but not its statements. ``BARE_STATEMENTS``
measures permits' statements without its client: the schema is permits' own, made by permits, and each
client sends the very statements permits sends for a one-semaphore grant and its release, captured from
the library as it runs them once, then prepared on one autocommit connection, as the floors send theirs.
A refused grant counts as refused and is asked again at once, as the floors do; permits would wait. So it
measures the spread scenario: on a hot semaphore permits' line refuses a grant while another is granting,
and asking again at once is a retry storm there (and the grant captured may be the one asked in the line).

So it is what a client with no cost of its own would reach with permits' statements: where it stays above
0.7x of ``floor``, the rest of the distance is permits' client.

    cd benchmarks && python harness.py \
        --system baselines:FLOOR,history_floor:HISTORY_FLOOR,bare_statements:BARE_STATEMENTS,systems:PERMITS \
        --backend postgresql --scenario spread --clients 1,16 --seconds 5 --warmup 1 --cpu
"""

from __future__ import annotations

import uuid
from typing import Any

from harness import Scenario, backend_of, connect
from systems import PermitsSystem

import permits
import permits._sync.store as sync_store


def captured_statements(url: str, name: str, owner: str) -> list[tuple[str, dict[str, Any]]]:
    """The statements (text and parameters) the sync store sends, alone, for one acquire and its release."""
    sent: list[tuple[str, dict[str, Any]]] = []
    send = sync_store._send_autocommit

    def spy(driver: Any, sql: str, params: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append((sql, dict(params)))
        return send(driver, sql, params, *args, **kwargs)

    sync_store._send_autocommit = spy
    try:
        with permits.connect(url, owner=owner) as client:
            client.release(client.acquire({name: 1}, ttl=60, timeout=5))
    finally:
        sync_store._send_autocommit = send
    # A grant refused on a hot semaphore is asked again after a wait: the last grant is the one that took.
    grants = [statement for statement in sent if "name" in statement[1]]
    if not grants or "name" in sent[-1][1]:
        raise RuntimeError(f"expected a grant and a release sent alone, saw {len(sent)} statements")
    return [grants[-1], sent[-1]]


class BareStatementsSystem(PermitsSystem):
    name = "bare-statements"

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        if backend_of(backend_url) != "postgresql" or scenario.per_acquire != 1:
            raise ValueError("permits' statements are sent bare on PostgreSQL, one semaphore per acquire")
        super().setup(backend_url, scenario)

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> BareStatementsClient:
        (name,) = scenario.semaphores_for(client_index)
        return BareStatementsClient(backend_url, name, f"bare-{client_index}-{uuid.uuid4().hex[:8]}")


class BareStatementsClient:
    def __init__(self, url: str, name: str, owner: str) -> None:
        (self._grant, self._grant_params), (self._release, self._release_params) = captured_statements(url, name, owner)
        self._conn: Any = connect(url)  # autocommit
        self._cur: Any = self._conn.cursor()
        self._serial = 0

    def cycle(self) -> bool:
        self._serial += 1
        key = f"k{self._serial}"
        self._grant_params["key"] = self._release_params["key"] = key
        self._cur.execute(self._grant, self._grant_params, prepare=True)
        if self._cur.fetchone() is None:
            return False
        self._cur.execute(self._release, self._release_params, prepare=True)
        self._cur.fetchall()
        return True

    def close(self) -> None:
        self._conn.close()


BARE_STATEMENTS = BareStatementsSystem()
