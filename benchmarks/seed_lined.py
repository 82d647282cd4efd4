"""An experiment, not permits: the seed's design on SQLite, with its writers served in turn by permits'
write line (docs/benchmarks.md, "The seed on SQLite, served in turn").

On SQLite the seed's design (``baselines.SEED``) runs ahead of permits from 4 clients up, and it is also
the one system there whose processes do not share: a writer that finds SQLite's write lock taken sleeps in
the busy handler (1 ms, then 2, 5, 10 ... up to 100 ms) and tries again, while the process that has just
committed takes the lock again at once. So one process at a time does most of the cycles, with its page
cache warm and no hand-over between processes; in the full run its Jain index fell to 0.20 at 64 clients,
40% of its tries were refused, clients failed with "database is locked", and permits were left acquired.

``SEED_LINED`` is the same seed, statement for statement, with every write transaction (the acquire's,
and each of the release's two autocommitted UPDATEs) taken in turn in the write line that permits keeps
beside the database (``permits.stores.host_lines``), before its first write, as permits' store takes it.
Its reads (the idempotency SELECT) run outside the line, as permits' reads do. So the two designs are
compared with writers served in the same order: what is left between them is the design's own cost.

    cd benchmarks && python harness.py --system baselines:SEED,seed_lined:SEED_LINED,systems:PERMITS \
        --backend sqlite --scenario hot --clients 1,4,16,64 --seconds 5 --warmup 1
"""

from __future__ import annotations

from collections.abc import Sequence

from baselines import SeedClient, SeedSystem
from harness import LOCK_WAIT_SECONDS, Scenario, backend_of, sqlite_path

from permits.stores.host_lines import WRITE_LINE, HostLines, supported


class SeedLinedSystem(SeedSystem):
    name = "seed-lined"

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> SeedClient:
        if backend_of(backend_url) != "sqlite" or not supported():
            raise ValueError("the write line is kept beside a SQLite database, on Linux")
        return SeedLinedClient(backend_url, scenario.semaphores_for(client_index), client_index)


class SeedLinedClient(SeedClient):
    def __init__(self, backend_url: str, names: Sequence[str], client_index: int) -> None:
        super().__init__(backend_url, names, client_index)
        self._lines = HostLines(sqlite_path(backend_url))

    def _acquire_once(self, external_id: str) -> bool:
        # The seed's BEGIN IMMEDIATE, its locking read, its sums, its two INSERTs and its COMMIT: one write
        # transaction, in one turn. A turn that did not come within the lock wait asks unordered, as
        # permits' store does.
        with self._lines.turn(WRITE_LINE, LOCK_WAIT_SECONDS):
            return super()._acquire_once(external_id)

    def release(self, external_id: str) -> None:
        db, s = self._db, self._s
        found = db.one(s.find_request, (external_id,))
        if found is None or found[1] != "ACQUIRED":
            return
        request_id = found[0]
        # The seed's two autocommitted UPDATEs are two write transactions: a turn each.
        with self._lines.turn(WRITE_LINE, LOCK_WAIT_SECONDS):
            db.run(s.release_permits, (request_id,))
        with self._lines.turn(WRITE_LINE, LOCK_WAIT_SECONDS):
            db.run(s.release_request, (request_id,))

    def close(self) -> None:
        try:
            self._lines.close()
        finally:
            super().close()


SEED_LINED = SeedLinedSystem()
