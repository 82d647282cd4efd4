"""Lines for MariaDB's waiters: ``permits_line``, a table of rows that are never written; and names compared
byte for byte on MariaDB databases made through a ``mariadb://`` URL.

A waiting acquire on a single MariaDB server takes its turn by locking one of these rows (``FOR UPDATE``),
picked by the semaphore's name (``MOD(CRC32(name), 1023)``): InnoDB grants a row's lock to its waiters in
the order they asked, so the row is a line, as PostgreSQL's advisory locks are. A grant asked outside the
line takes a shared lock on the row with ``SKIP LOCKED``, and is refused while anyone holds or waits for it
(docs/design.md, "Waiters queue in the server's lock queue"). Only the locks matter: the rows carry no data,
so their number is fixed and they replicate nothing once made. Semaphores whose names fall on the same row
share its line, as they share one of SQLite's 1,023 lines.

Made on MariaDB and MySQL only (MySQL and Galera nodes do not use it yet); other engines have their own
lines.

A permits older than this revision ran a ``mariadb://`` URL through SQLAlchemy's dialect of that name, and
the earlier migrations, which look for the name ``mysql``, then left the names, keys and owners in the
server's default collation: ``lock``, ``Lock`` and ``lock `` were one semaphore. Such columns get the
byte-exact collation here (a stricter comparison, under which the unique keys stay unique).

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


#: The columns that compare names, keys and owners (revisions 0001, 0003 and 0004), and whether each may be NULL.
EXACT_COLUMNS = {
    "permits_semaphore": {"name": False},
    "permits_lease": {"owner": False, "lease_key": False},
    "permits_capacity_change": {"name": False},
    "permits_waiter": {"owner": False, "lease_key": False},
    "permits_stat": {"name": False},
    "permits_instance_stat": {"name": False},
    "permits_admin_log": {"name": True, "lease_owner": True, "lease_key": True},
}


def _exact_collations() -> None:
    """Give the byte-exact collation to the name, key and owner columns that lack it (see above)."""
    bind = op.get_bind()
    exact = "utf8mb4_nopad_bin" if getattr(bind.dialect, "is_mariadb", False) else "utf8mb4_0900_bin"
    found = bind.execute(
        sa.text(
            "SELECT TABLE_NAME, COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS"
            " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE 'permits\\_%'"
        )
    ).all()
    for table, column, collation in found:
        nullable = EXACT_COLUMNS.get(str(table), {}).get(str(column))
        if nullable is not None and collation != exact:
            op.alter_column(
                str(table),
                str(column),
                existing_type=sa.String(255),
                type_=sa.String(255, collation=exact),
                existing_nullable=nullable,
            )


def upgrade() -> None:
    if op.get_bind().dialect.name != "mysql":
        return
    _exact_collations()
    line = op.create_table(
        "permits_line",
        sa.Column("id", sa.SmallInteger, primary_key=True, autoincrement=False),
        mysql_engine="InnoDB",  # the row locks are the line
    )
    op.bulk_insert(line, [{"id": i} for i in range(LINES)])


def downgrade() -> None:
    if op.get_bind().dialect.name == "mysql":
        op.drop_table("permits_line")
