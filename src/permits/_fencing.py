"""What the sync and asyncio fencing guards share: their SQL, their argument checks, their verdict."""

from __future__ import annotations

import re
from typing import Any, Literal

from sqlalchemy import TextClause, text

from permits import _validate
from permits._exceptions import InvalidArgument, StaleFencingToken

_TABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class FenceStatements:
    def __init__(self, table: str) -> None:
        if not _TABLE_NAME.match(table):
            raise InvalidArgument(f"not a plain table name: {table!r}", field="table")
        self.table = table
        # Raise the recorded token to ours when ours is at least as high; this locks the row.
        self.advance = text(f"UPDATE {table} SET token = :token WHERE resource = :resource AND token <= :token")
        self.first = text(f"INSERT INTO {table} (resource, token) VALUES (:resource, :token)")
        self._highest = f"SELECT token FROM {table} WHERE resource = :resource"

    def highest(self, dialect: str, locking: bool = True) -> TextClause:
        # A locking read sees the latest committed token on MariaDB/MySQL at REPEATABLE READ, where a plain
        # SELECT would read the transaction's old snapshot. SQLite has no row locks (and needs none).
        lock = " FOR UPDATE" if locking and dialect != "sqlite" else ""
        return text(self._highest + lock)

    def create(self, dialect: str) -> TextClause:
        # SQLAlchemy names MySQL's dialect "mariadb" for a mariadb:// URL: the same server family.
        binary = " COLLATE utf8mb4_bin"
        collation = {"mysql": binary, "mariadb": binary, "postgresql": ' COLLATE "C"'}.get(dialect, "")
        return text(
            f"CREATE TABLE IF NOT EXISTS {self.table} ("
            f"resource VARCHAR(255){collation} NOT NULL PRIMARY KEY, token BIGINT NOT NULL)"
        )


def check_args(resource: object, token: object) -> dict[str, Any]:
    name = _validate.name(resource, field="resource")
    if isinstance(token, bool) or not isinstance(token, int) or not 1 <= token <= 2**63 - 1:
        raise InvalidArgument("a fencing token is a whole number from 1 to 2**63-1", field="token")
    return {"resource": name, "token": token}


def verdict(params: dict[str, Any], highest: Any) -> Literal["first", "accept", "advance"]:
    """What to do after the conditional UPDATE changed no row and a locking read found ``highest``:

    - ``"first"``: no token was ever recorded for the resource; record ours;
    - ``"accept"``: ours is the one recorded (MySQL counts only changed rows, so the UPDATE said 0);
    - ``"advance"``: a lower token committed after the UPDATE's snapshot (PostgreSQL at READ COMMITTED
      finds a row inserted meanwhile only in a later statement); the row is locked now, so raise it again.

    Raises ``StaleFencingToken`` when a higher token was accepted."""
    if highest is None:
        return "first"
    if int(highest) == params["token"]:
        return "accept"
    if int(highest) < params["token"]:
        return "advance"
    raise StaleFencingToken(
        f"fencing token {params['token']} for {params['resource']!r} is stale: {int(highest)} was accepted already",
        resource=params["resource"],
        token=params["token"],
        highest=int(highest),
    )
