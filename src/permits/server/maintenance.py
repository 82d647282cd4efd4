"""Maintenance: reclaim expired leases, release the leases of dead owners and of stale holders, and delete
old rows. Every task runs on one instance at a time, elected by a permits lease, and every run is logged
and counted. ``permits maintain`` runs each task once, for cron.

Tasks and their semaphores (capacity 1, created on first use):

    sweep       permits:maintenance:sweep       end expired leases, in batches
    liveness    permits:maintenance:liveness    ask each owner's liveness check; release dead owners' leases
    staleness   permits:maintenance:staleness   release leases held longer than max_lease_age
    cleanup     permits:maintenance:cleanup     delete ended leases and old capacity history, in batches
    stats       permits:maintenance:stats       sample every semaphore for the dashboard's charts
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from permits._core import observe
from permits._exceptions import PermitsError
from permits._io import monotonic
from permits._models import EndReason

if TYPE_CHECKING:
    from permits.server.state import ServiceState

logger = logging.getLogger("permits.maintenance")

#: A liveness check: given an owner, True (alive), False (dead) or None (cannot tell: release nothing).
LivenessProbe = Callable[[str], "bool | Awaitable[bool | None] | None"]
SEMAPHORE_PREFIX = "permits:maintenance:"
#: How long one liveness HTTP callback may take.
LIVENESS_TIMEOUT = 5.0
#: A sweep's run starts no batch after this share of its lease's TTL (its first batch always runs), so
#: that the lease outlives it and no other instance sweeps beside it: the next runs sweep what is left.
SWEEP_RUN_SHARE = 0.5


def task_lease_ttl(interval: float) -> float:
    """The TTL of the lease a task's run holds: it outlives a slow run (so no second instance starts
    meanwhile) but not a dead one."""
    return max(30.0, interval * 2)


@dataclass(frozen=True)
class Task:
    name: str
    interval: float
    run: Callable[[], Awaitable[dict[str, Any]]]


class Maintainer:
    def __init__(self, state: ServiceState, probes: dict[str, LivenessProbe] | None = None) -> None:
        self.state = state
        self.config = state.config.maintenance
        self.instance = uuid.uuid4().hex[:12]
        self.probes: dict[str, LivenessProbe] = dict(probes or state.liveness_probes)
        for check in self.config.liveness:
            self.probes.setdefault(check.prefix, _http_probe(check.url))

    def tasks(self) -> list[Task]:
        c = self.config
        tasks = [Task("sweep", c.sweep_interval, self.sweep), Task("cleanup", c.cleanup_interval, self.cleanup)]
        if self.probes:
            tasks.append(Task("liveness", c.liveness_interval, self.liveness))
        if c.max_lease_age is not None:
            tasks.append(Task("staleness", c.staleness_interval, self.staleness))
        if self.state.config.dashboard.enabled:
            tasks.append(Task("stats", self.state.config.dashboard.step, self.sample))
        return tasks

    def start(self) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self._loop(task), name=f"permits-{task.name}") for task in self.tasks()]

    async def _loop(self, task: Task) -> None:
        # Instances started together should not all ask for the same task at the same moment.
        await asyncio.sleep(task.interval * (0.1 + 0.4 * (hash(self.instance) % 100) / 100))
        while True:
            await self.run_once(task)
            await asyncio.sleep(task.interval)

    async def run_once(self, task: Task) -> str:
        """Run ``task`` if this instance wins its lease; returns done, skipped or failed."""
        client = self.state.client
        name = SEMAPHORE_PREFIX + task.name
        started = monotonic()
        try:
            await client.create_semaphore(name, 1, exist_ok=True)
            lease = await client.try_acquire(
                name,
                owner="permits-maintenance",
                key=f"{self.instance}-{uuid.uuid4().hex}",
                ttl=task_lease_ttl(task.interval),
            )
            if lease is None:
                outcome, summary = "skipped", {}
            else:
                try:
                    summary = await task.run()
                finally:
                    with contextlib.suppress(PermitsError):
                        await client.release(lease)
                outcome = "done"
        except PermitsError as exc:
            outcome, summary = "failed", {"error": exc.code, "message": str(exc)}
        except Exception as exc:  # a bug in a liveness callable must not stop maintenance
            logger.exception("maintenance task %s crashed", task.name)
            outcome, summary = "failed", {"error": type(exc).__name__}
        self.state.metrics.maintenance_runs.labels(task.name, outcome).inc()
        # A run that found nothing to do is routine: DEBUG, so a sweep every 5 s does not fill the log.
        did_something = any(isinstance(v, int) and v for v in summary.values())
        level = logging.WARNING if outcome == "failed" else logging.INFO if did_something else logging.DEBUG
        if logger.isEnabledFor(level):
            left = ", left some for the next run" if summary.get("complete") is False else ""
            logger.log(
                level,
                "maintenance %s %s%s",
                task.name,
                outcome,
                left,
                extra={"task": task.name, "outcome": outcome, "seconds": round(monotonic() - started, 3), **summary},
            )
        return outcome

    # ---------------------------------------------------------------------------------------------- tasks

    async def sweep(self) -> dict[str, Any]:
        within = SWEEP_RUN_SHARE * task_lease_ttl(self.config.sweep_interval)
        result = await self.state.client.sweep(batch_size=self.config.sweep_batch, timeout=within)
        if result.leases:
            self.state.metrics.reclaims.labels("swept").inc(result.leases)
        # Said only when the run left some: a complete sweep is routine (see run_once's log level).
        return {"leases": result.leases, "batches": result.batches, **({} if result.complete else {"complete": False})}

    async def liveness(self) -> dict[str, Any]:
        store = self.state.sql_store
        released = checked = 0
        for owner in await store.held_owners():
            probe = self._probe_for(owner)
            if probe is None:
                continue
            checked += 1
            alive = await _ask(probe, owner)
            if alive is False:
                keys = await store.end_owner_leases(
                    owner, EndReason.OWNER_DEAD, "the liveness check found the owner dead", self.config.sweep_batch
                )
                if keys:
                    logger.warning("released %d lease(s) of dead owner %s", len(keys), owner)
                    self.state.metrics.reclaims.labels("owner_dead").inc(len(keys))
                    self.state.waker.notify_all()
                released += len(keys)
        return {"owners_checked": checked, "leases": released}

    async def staleness(self) -> dict[str, Any]:
        max_age = self.config.max_lease_age
        assert max_age is not None
        note = f"held longer than the service's max_lease_age of {max_age:g} s"
        result = await self.state.sql_store.end_stale(round(max_age * 1000), note, self.config.sweep_batch)
        if result.leases:
            self.state.metrics.reclaims.labels("stale").inc(result.leases)
            self.state.waker.notify_all()
        return {"leases": result.leases}

    async def cleanup(self) -> dict[str, Any]:
        store = self.state.sql_store
        leases = await store.delete_ended_leases(round(self.config.keep_ended_leases * 1000), self.config.cleanup_batch)
        history = await store.delete_capacity_history(
            round(self.config.keep_capacity_history * 1000), self.config.cleanup_batch
        )
        # Admin log entries are kept as long as the capacity history. Administrators act through the
        # service whether or not the dashboard is on, so this is cleanup's job, not the stats task's.
        admin_log = await store.run_flow(
            lambda: observe.prune_admin_log(round(self.config.keep_capacity_history * 1000))
        )
        # Places in fair queues that expired a minute ago or more: their waiters gave up or died.
        places = await store.purge_waiters(60_000)
        return {
            "leases_deleted": leases,
            "history_deleted": history,
            "admin_log_deleted": admin_log,
            "places_deleted": places,
        }

    async def sample(self) -> dict[str, Any]:
        dashboard = self.state.config.dashboard
        step_ms, keep_ms = round(dashboard.step * 1000), round(dashboard.keep_stats * 1000)
        rows = await self.state.sql_store.run_flow(lambda: observe.take_sample(step_ms, keep_ms))
        # A string, not a count: a routine sample every step is logged at DEBUG, not INFO (see run_once).
        return {"samples": str(rows)}

    def _probe_for(self, owner: str) -> LivenessProbe | None:
        # The longest matching prefix wins, so a specific check can override a general one.
        matches = [p for p in self.probes if owner.startswith(p)]
        return self.probes[max(matches, key=len)] if matches else None


async def _ask(probe: LivenessProbe, owner: str) -> bool | None:
    try:
        answer = probe(owner)
        if inspect.isawaitable(answer):
            answer = await answer
    except Exception:
        logger.warning("liveness check for %s failed; releasing nothing", owner, exc_info=True)
        return None
    return answer if answer is None else bool(answer)


def _http_probe(url_template: str) -> LivenessProbe:
    async def probe(owner: str) -> bool | None:
        url = url_template.replace("{owner}", quote(owner, safe=""))
        async with httpx.AsyncClient(timeout=LIVENESS_TIMEOUT) as http:
            try:
                response = await http.get(url)
            except httpx.HTTPError:
                return None
        if response.status_code == 200:
            return True
        if response.status_code in (404, 410):
            return False
        return None

    return probe
