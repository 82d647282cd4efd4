"""Fair mode: a semaphore may serve its waiters in arrival order. Waiting requests take a ticket (a
counter on the semaphore row, like fencing tokens) and a place in permits_waiter, which expires unless the
waiter keeps asking.

Revision ID: 0003
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _exact_text_collation() -> str | None:
    bind = op.get_bind()
    if bind.dialect.name == "mysql":
        return "utf8mb4_nopad_bin" if getattr(bind.dialect, "is_mariadb", False) else "utf8mb4_0900_bin"
    if bind.dialect.name == "postgresql":
        return "C"
    return None


def _name(column: str) -> sa.Column[Any]:
    return sa.Column(column, sa.String(255, collation=_exact_text_collation()), nullable=False)


def upgrade() -> None:
    # Constant defaults: an instant change on MariaDB 10.3+ and PostgreSQL 11+, whatever the table's size.
    op.add_column("permits_semaphore", sa.Column("fair", sa.SmallInteger(), nullable=False, server_default="0"))
    op.add_column("permits_semaphore", sa.Column("last_ticket", sa.BigInteger(), nullable=False, server_default="0"))
    op.create_table(
        "permits_waiter",
        sa.Column("semaphore_id", sa.BigInteger(), nullable=False),
        sa.Column("ticket", sa.BigInteger(), nullable=False),
        _name("owner"),
        _name("lease_key"),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("enqueued_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("expires_at_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("semaphore_id", "ticket", name="pk_permits_waiter"),
        sa.UniqueConstraint("owner", "lease_key", "semaphore_id", name="uq_permits_waiter_request"),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


def downgrade() -> None:
    op.drop_table("permits_waiter")
    op.drop_column("permits_semaphore", "last_ticket")
    op.drop_column("permits_semaphore", "fair")
