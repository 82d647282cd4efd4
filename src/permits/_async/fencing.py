"""The fencing guard (see ``permits.fencing``); the sync twin is generated from this file."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from permits._fencing import FenceStatements, check_args, verdict


class AsyncFencingGuard:
    """Refuses writes whose fencing token is lower than the highest accepted for their resource."""

    def __init__(self, table: str = "permits_fence") -> None:
        self._sql = FenceStatements(table)

    async def install(self, conn: AsyncConnection) -> None:
        """Create the fence table if it is missing (idempotent)."""
        await conn.execute(self._sql.create(conn.dialect.name))

    async def check(self, conn: AsyncConnection, resource: str, token: int) -> None:
        """Accept ``token`` for ``resource`` and record it, or raise ``StaleFencingToken``. Call it inside
        the transaction of the write it guards, so that the check and the write commit together."""
        params = check_args(resource, token)
        while True:
            if (await conn.execute(self._sql.advance, params)).rowcount > 0:
                return
            found = await conn.execute(self._sql.highest(conn.dialect.name), params)
            next_step = verdict(params, found.scalar())
            if next_step == "accept":
                return
            if next_step == "advance":
                continue
            # A savepoint: losing the race for the first token must not undo the caller's own work.
            savepoint = await conn.begin_nested()
            try:
                await conn.execute(self._sql.first, params)
            except IntegrityError:
                await savepoint.rollback()
                continue  # another writer recorded the first token meanwhile: compare with it
            except DBAPIError:
                # Not rolled back to the savepoint: MariaDB and MySQL end a deadlocked transaction whole,
                # savepoints and all, so that rollback would fail ("SAVEPOINT does not exist") and hide the
                # deadlock, which the caller must see to retry its transaction. Its rollback undoes this.
                raise
            await savepoint.commit()
            return

    async def highest(self, conn: AsyncConnection, resource: str) -> int | None:
        """The highest token accepted for ``resource`` so far, or None."""
        found = await conn.execute(self._sql.highest(conn.dialect.name, locking=False), {"resource": resource})
        value = found.scalar()
        return None if value is None else int(value)
