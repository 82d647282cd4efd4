"""What this instance saw, per semaphore, written to the database every step for the dashboard's charts.

Refusals, timeouts, waiting requests and wait times are known only to the instance that answered the
request, so each instance counts them in memory (a dict lookup per acquire, no I/O) and writes one row
per active semaphore every ``dashboard.step`` seconds, plus a heartbeat row. A failed write keeps the
counts for the next one; a crash loses at most one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from permits._core import observe
from permits._exceptions import PermitsError

if TYPE_CHECKING:
    from permits.server.state import ServiceState

logger = logging.getLogger("permits.server.stats")


class InstanceStats:
    """Counts per semaphore since the last write, and the requests waiting right now."""

    def __init__(self, max_names: int) -> None:
        self.instance = uuid.uuid4().hex[:16]
        self.max_names = max_names
        self._seen: dict[str, observe.Seen] = {}
        self._waiting: dict[str, int] = {}

    def _entry(self, name: str) -> observe.Seen | None:
        entry = self._seen.get(name)
        if entry is None and len(self._seen) < self.max_names:
            entry = self._seen[name] = observe.Seen()
        return entry  # beyond max_names, new names go uncounted until the next write

    def outcome(self, names: Iterable[str], outcome: str, waited_s: float) -> None:
        for name in names:
            entry = self._entry(name)
            if entry is None:
                continue
            if outcome == "granted":
                entry.granted += 1
                observe.histogram_add(entry.wait_hist, waited_s * 1000)
            elif outcome == "refused":
                entry.refused += 1
            elif outcome == "timeout":
                entry.timeouts += 1

    @contextlib.contextmanager
    def waiting(self, names: Iterable[str]) -> Iterator[None]:
        names = list(names)
        for name in names:
            self._waiting[name] = self._waiting.get(name, 0) + 1
        try:
            yield
        finally:
            for name in names:
                left = self._waiting[name] - 1
                if left:
                    self._waiting[name] = left
                else:
                    del self._waiting[name]

    def take(self) -> dict[str, observe.Seen]:
        """The counts to write now (and reset), with the waiting counts and the heartbeat row."""
        seen, self._seen = self._seen, {}
        for name, n in self._waiting.items():
            entry = seen.setdefault(name, observe.Seen())
            entry.waiting = n
        seen.setdefault(observe.ALL_SEMAPHORES, observe.Seen())
        return seen

    def put_back(self, seen: dict[str, observe.Seen]) -> None:
        """A write failed: merge its counts into the next one."""
        for name, entry in seen.items():
            entry.waiting = 0  # waiting is a snapshot: the next one replaces it
            mine = self._seen.get(name)
            if mine is None:
                self._seen[name] = entry
            else:
                mine.merge(entry)


async def write_instance_stats(state: ServiceState) -> None:
    """Every step, write what this instance saw (runs on every instance)."""
    stats = state.instance_stats
    while True:
        await asyncio.sleep(state.config.dashboard.step)
        seen = stats.take()
        try:
            await state.sql_store.run_flow(lambda seen=seen: observe.record_instance(stats.instance, seen))
        except PermitsError as exc:
            stats.put_back(seen)
            logger.warning("could not write this instance's dashboard counts: %s", exc)
