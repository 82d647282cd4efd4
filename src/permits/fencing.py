"""The downstream half of fencing tokens: a guard that a SQL store calls inside its own transaction.

A lease can end while its holder still acts: a GC pause, a stopped VM or a slow network outlasts the TTL,
someone else is granted the permit, and the first holder, unaware, carries on writing. The lock service
cannot stop that write; the store that receives it can. Every grant carries a fencing token that
strictly increases per semaphore, so the store keeps the highest token it has accepted per resource and
refuses any write that carries a lower one::

    guard = FencingGuard()                       # table permits_fence, in *your* database
    with engine.begin() as conn:
        guard.install(conn)                      # once: CREATE TABLE IF NOT EXISTS
    ...
    with engine.begin() as conn:                 # the transaction of the write itself
        guard.check(conn, "invoice-42", lease.token)   # raises StaleFencingToken, or records the token
        conn.execute(text("UPDATE invoices SET ... WHERE id = 42"))

Because the check and the write commit together, a stale holder's write is refused whole, and two
holders' checks on one resource are serialised by the fence row's lock. A write with the same token as
the highest seen is accepted (the same holder writing again). Works on SQLite, MariaDB/MySQL and
PostgreSQL, through any SQLAlchemy ``Connection``; ``AsyncFencingGuard`` takes an ``AsyncConnection``.
"""

from __future__ import annotations

from permits._async.fencing import AsyncFencingGuard
from permits._exceptions import StaleFencingToken
from permits._sync.fencing import FencingGuard

__all__ = ["AsyncFencingGuard", "FencingGuard", "StaleFencingToken"]
