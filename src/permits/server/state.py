"""What one service instance holds while it runs: its settings, its client, its queues and its metrics.

Nothing here is the source of truth: every grant, release and count lives in the database, so any number
of instances can serve one database, and an instance can be killed at any moment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from permits import _validate
from permits._async.client import AsyncClient
from permits._config import DEFAULT_TTL, Settings
from permits._deadline import caller_deadline
from permits._exceptions import ConfigurationError, LeaseNotFound, LimitExceeded
from permits._io import monotonic
from permits._models import Lease
from permits.server.auth import Authenticator, Identity
from permits.server.config import ServerConfig
from permits.server.events import Broadcaster
from permits.server.handoff import HandOff
from permits.server.maintenance import LivenessProbe
from permits.server.metrics import Metrics
from permits.server.prelock import InstanceStore, PreLock, Waker
from permits.server.stats import InstanceStats
from permits.stores import async_sql_store
from permits.stores.base import AsyncStore

#: The owner the service's own client records (capacity changes made with no ``who``).
SERVICE_OWNER = "permits-service"
#: How old a client's count of held leases may be before the quota check reads it again.
QUOTA_REFRESH_SECONDS = 1.0


@dataclass
class _Quota:
    count: int
    read_at: float
    granted_since: int = 0


@dataclass
class ServiceState:
    config: ServerConfig
    client: AsyncClient
    #: the database store: AsyncSQLStore, or SQLite's ThreadedSQLStore (with the same methods)
    sql_store: Any
    instance_store: InstanceStore
    auth: Authenticator
    metrics: Metrics
    #: liveness checks given as Python callables, by owner prefix (create_app(liveness=...))
    liveness_probes: dict[str, LivenessProbe] = field(default_factory=dict)
    _quotas: dict[str, _Quota] = field(default_factory=dict)
    #: what this instance saw, for the dashboard (see server/stats.py)
    instance_stats: InstanceStats = field(init=False)
    #: the dashboard's live event feed (see server/events.py)
    broadcaster: Broadcaster = field(init=False)

    def __post_init__(self) -> None:
        self.instance_stats = InstanceStats(max(1, self.config.metrics_max_semaphores))
        dashboard = self.config.dashboard
        self.broadcaster = Broadcaster(self.sql_store, dashboard.poll_interval, dashboard.max_streams)

    @classmethod
    def build(
        cls,
        config: ServerConfig,
        metrics: Metrics | None = None,
        liveness: dict[str, LivenessProbe] | None = None,
    ) -> ServiceState:
        metrics = metrics or Metrics()
        # A request without a TTL gets the usual default, within the bound this service sets.
        default_ttl = min(DEFAULT_TTL, config.limits.max_ttl)
        settings = Settings.build(
            config.database_url,
            owner=SERVICE_OWNER,
            ttl=default_ttl,
            lock_wait_timeout=config.lock_wait_timeout,
            retries=config.retries,
            auto_upgrade=None,
            pool_size=config.db_pool_size,
            reply_timeout=config.reply_timeout,
            max_ttl=config.limits.max_ttl,
        )
        if settings.url.get_backend_name() not in ("sqlite", "mysql", "mariadb", "postgresql"):
            raise ConfigurationError(
                "the service keeps its state in a SQL database: use sqlite://, mysql:// or postgresql://",
                field="database_url",
            )
        sql_store = async_sql_store(settings)
        sql_store.on_retry = lambda fault: metrics.store_retries.labels(fault).inc()
        sql_store.on_reply_cut = lambda event: metrics.reply_cuts.labels(event).inc()
        prelock = PreLock(config.prelock, config.prelock_wait, on_wait=metrics.prelock_wait_seconds.observe)
        waker = Waker(config.limits.max_waiters)
        instance_store = InstanceStore(sql_store, prelock, waker, on_hold=metrics.hold_seconds.observe)
        instance_store.handoff = HandOff(sql_store, prelock, waker, on_turn=metrics.observe_turn)
        # Attempts go through the pre-lock, and waits hear the releases this instance sees.
        client = AsyncClient(
            config.database_url,
            owner=SERVICE_OWNER,
            ttl=default_ttl,
            lock_wait_timeout=config.lock_wait_timeout,
            retries=config.retries,
            store=cast(AsyncStore, instance_store),
        )
        # A request waiting for room gets the outage (503 storage_unavailable) or the drain (503
        # service_unavailable) at once, not ridden out here: its client rides it out, or asks another instance.
        client._rides_out_outages = False
        metrics.prelock_waiting.set_function(lambda: prelock.waiting)
        metrics.waiters.set_function(lambda: waker.waiters)
        metrics.db_connections.set_function(lambda: sql_store.connections_in_use)
        return cls(config, client, sql_store, instance_store, Authenticator(config), metrics, dict(liveness or {}))

    @property
    def waker(self) -> Waker:
        return self.instance_store.waker

    async def check_lease_quota(
        self, identity: Identity, owner: str, key: str | None, deadline: float | None = None
    ) -> None:
        """Refuse a new acquire (429) when the identity holds ``max_leases_per_client`` leases already.

        The count is read at most once a second per instance and advanced by the grants made here since;
        when that estimate reaches the bound, the count is read again before a refusal, so that releases
        and retries since the last read never refuse a client below its bound. Across several instances the
        bound can be passed by the grants of the last second. A retry of a request that was granted (``key``
        holds a live lease: the reply was lost) is not a new acquire: it is let through, and answered from
        that lease. The reads it makes hold to ``deadline`` (``permits._deadline``); most checks make none.
        """
        if not identity.scoped:
            return
        limit = self.config.limits.max_leases_per_client
        quota = self._quotas.get(identity.name)
        now = monotonic()
        fresh = False
        if quota is None or now - quota.read_at > QUOTA_REFRESH_SECONDS:
            quota, fresh = await self._read_quota(identity.name, now, deadline), True
        if quota.count + quota.granted_since >= limit and not fresh:
            # The estimate only says the bound may be near: it counts every grant made here since the
            # read, retries and leases released since included. A refusal rests on a count read now.
            quota = await self._read_quota(identity.name, now, deadline)
        if quota.count >= limit:
            # Checked before the lookup: the database must not be sent what it cannot take (a NUL in a key is
            # an error on PostgreSQL), and bad input is a 422 whatever the quota. Below the bound, the client
            # checks them as for any request.
            if key is not None:
                _validate.key(key)
            _validate.owner(owner)
            if key is not None and await self._holds(owner, key, deadline):
                return
            raise LimitExceeded(
                f"{identity.name!r} holds {limit} leases, the most this service allows per client",
                limit="max_leases_per_client",
            )

    async def _read_quota(self, identity: str, now: float, deadline: float | None) -> _Quota:
        with caller_deadline(deadline):
            quota = _Quota(await self.sql_store.count_held_leases(identity), now)
        self._quotas[identity] = quota
        return quota

    async def _holds(self, owner: str, key: str, deadline: float | None) -> bool:
        try:
            with caller_deadline(deadline):
                lease: Lease = await self.sql_store.get_lease(owner, key)
        except LeaseNotFound:
            return False
        return lease.held

    def note_granted(self, identity: Identity) -> None:
        quota = self._quotas.get(identity.name)
        if quota is not None:
            quota.granted_since += 1
