"""permits: distributed counting semaphores, mutexes and leases on the SQL database you already run.

import permits

with permits.connect() as client:                 # sqlite:///permits.db, or $PERMITS_DATABASE_URL
    client.create_semaphore("backups", 10, exist_ok=True)
    with client.lease("backups", ttl=300, timeout=60) as lease:
        run_backup(fencing_token=lease.token)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from permits._async.client import AsyncClient, AsyncHeld
from permits._async.watchdog import AsyncWatchdog
from permits._config import DEFAULT_LOCK_WAIT_TIMEOUT, DEFAULT_RETRIES, DEFAULT_TTL, DEFAULT_URL
from permits._exceptions import (
    AcquireTimeout,
    ConfigurationError,
    CountExceedsCapacity,
    Forbidden,
    IdempotencyConflict,
    InvalidArgument,
    KeyInUse,
    LeaseError,
    LeaseLost,
    LeaseNotFound,
    LimitExceeded,
    PermitsError,
    RequestTooLarge,
    SchemaMismatch,
    SemaphoreExists,
    SemaphoreInUse,
    SemaphoreNotFound,
    ServiceError,
    ServiceUnavailable,
    StaleFencingToken,
    StorageConflict,
    StorageError,
    StorageReadOnly,
    StorageUnavailable,
    Unauthorized,
    UsageError,
    error_class,
    error_codes,
)
from permits._models import (
    RWLOCK_READERS,
    CapacityChange,
    Drift,
    EndReason,
    Holder,
    Lease,
    ReleaseOutcome,
    Semaphore,
    SweepResult,
    Waiter,
    Want,
    exclusive,
    shared,
)
from permits._sync.client import Client, Held
from permits._sync.watchdog import Watchdog

if TYPE_CHECKING:  # not imported otherwise: a client of a service needs no SQLAlchemy
    from sqlalchemy.engine import URL

__version__ = "0.1.0"


def connect(
    url: str | URL | None = None,
    *,
    owner: str | None = None,
    ttl: float | None = None,
    lock_wait_timeout: float = DEFAULT_LOCK_WAIT_TIMEOUT,
    retries: int = DEFAULT_RETRIES,
    auto_upgrade: bool | None = None,
    token: str | None = None,
    reply_timeout: float | None = None,
) -> Client:
    """Open a client. ``url`` picks the backend; ``None`` reads ``$PERMITS_DATABASE_URL``, else uses the
    embedded default ``sqlite:///permits.db``. See ``Client`` for the options."""
    return Client(
        url,
        owner=owner,
        ttl=ttl,
        lock_wait_timeout=lock_wait_timeout,
        retries=retries,
        auto_upgrade=auto_upgrade,
        token=token,
        reply_timeout=reply_timeout,
    )


def connect_async(
    url: str | URL | None = None,
    *,
    owner: str | None = None,
    ttl: float | None = None,
    lock_wait_timeout: float = DEFAULT_LOCK_WAIT_TIMEOUT,
    retries: int = DEFAULT_RETRIES,
    auto_upgrade: bool | None = None,
    token: str | None = None,
    reply_timeout: float | None = None,
) -> AsyncClient:
    """The asyncio twin of ``connect``: ``async with permits.connect_async(url) as client:``."""
    return AsyncClient(
        url,
        owner=owner,
        ttl=ttl,
        lock_wait_timeout=lock_wait_timeout,
        retries=retries,
        auto_upgrade=auto_upgrade,
        token=token,
        reply_timeout=reply_timeout,
    )


__all__ = [
    "AcquireTimeout",
    "AsyncClient",
    "AsyncHeld",
    "AsyncWatchdog",
    "CapacityChange",
    "Client",
    "ConfigurationError",
    "CountExceedsCapacity",
    "DEFAULT_LOCK_WAIT_TIMEOUT",
    "DEFAULT_RETRIES",
    "DEFAULT_TTL",
    "DEFAULT_URL",
    "Drift",
    "EndReason",
    "Forbidden",
    "Held",
    "Holder",
    "IdempotencyConflict",
    "InvalidArgument",
    "KeyInUse",
    "Lease",
    "LeaseError",
    "LeaseLost",
    "LeaseNotFound",
    "LimitExceeded",
    "PermitsError",
    "RWLOCK_READERS",
    "ReleaseOutcome",
    "RequestTooLarge",
    "SchemaMismatch",
    "Semaphore",
    "SemaphoreExists",
    "SemaphoreInUse",
    "SemaphoreNotFound",
    "ServiceError",
    "ServiceUnavailable",
    "StaleFencingToken",
    "StorageConflict",
    "StorageError",
    "StorageReadOnly",
    "StorageUnavailable",
    "SweepResult",
    "Unauthorized",
    "UsageError",
    "Waiter",
    "Want",
    "Watchdog",
    "connect",
    "connect_async",
    "error_class",
    "error_codes",
    "exclusive",
    "shared",
    "__version__",
]
