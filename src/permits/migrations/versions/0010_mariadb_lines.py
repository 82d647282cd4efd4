"""Lines for MariaDB's waiters: ``permits_line``, a table of rows that are never written.

A waiting acquire on a single MariaDB server takes its turn by locking one of these rows (``FOR UPDATE``),
picked by the semaphore's name (``MOD(CRC32(name), 1023)``): InnoDB grants a row's lock to its waiters in
the order they asked, so the row is a line, as PostgreSQL's advisory locks are. A grant asked outside the
line takes a shared lock on the row with ``SKIP LOCKED``, and is refused while anyone holds or waits for it
(docs/design.md, "Waiters queue in the server's lock queue"). Only the locks matter: the rows carry no data,
so their number is fixed and they replicate nothing once made. Semaphores whose names fall on the same row
share its line, as they share one of SQLite's 1,023 lines.

Made on MariaDB and MySQL only (MySQL and Galera nodes do not use it yet); other engines have their own
lines.

Revision ID: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

#: how many rows, and so lines, there are: the same count as SQLite's lines (stores/host_lines.py)
LINES = 1023


def upgrade() -> None:
    if op.get_bind().dialect.name != "mysql":
        return
    line = op.create_table(
        "permits_line",
        sa.Column("id", sa.SmallInteger, primary_key=True, autoincrement=False),
        mysql_engine="InnoDB",  # the row locks are the line
    )
    op.bulk_insert(line, [{"id": i} for i in range(LINES)])


def downgrade() -> None:
    if op.get_bind().dialect.name == "mysql":
        op.drop_table("permits_line")
