"""The first schema: semaphores, leases, permits and the capacity audit trail.

Revision ID: 0001
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _exact_text_collation() -> str | None:
    """A collation under which names compare byte for byte.

    MariaDB's default collations make "lock", "Lock", "lock " and "lóck" one key; even utf8mb4_bin pads
    trailing spaces. utf8mb4_nopad_bin (MariaDB) and utf8mb4_0900_bin (MySQL 8) compare exactly.
    PostgreSQL's "C" collation also makes ORDER BY follow byte order, which is the lock order.
    """
    bind = op.get_bind()
    if bind.dialect.name == "mysql":
        return "utf8mb4_nopad_bin" if getattr(bind.dialect, "is_mariadb", False) else "utf8mb4_0900_bin"
    if bind.dialect.name == "postgresql":
        return "C"
    return None  # SQLite compares with BINARY by default


def _name(column: str, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(column, sa.String(255, collation=_exact_text_collation()), nullable=nullable)


def _id() -> sa.Column[Any]:
    # INTEGER PRIMARY KEY is SQLite's rowid; BIGINT elsewhere. Ids are never fencing tokens.
    return sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True)


def _ms(column: str, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(column, sa.BigInteger(), nullable=nullable)


_TABLE_OPTIONS: dict[str, Any] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}


def upgrade() -> None:
    op.create_table(
        "permits_semaphore",
        _id(),
        _name("name"),
        sa.Column("capacity", sa.BigInteger(), nullable=False),
        sa.Column("used", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("last_token", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("deleted", sa.SmallInteger(), nullable=False, server_default="0"),
        _ms("created_at_ms"),
        _ms("updated_at_ms"),
        sa.UniqueConstraint("name", name="uq_permits_semaphore_name"),
        sa.CheckConstraint("used >= 0", name="ck_permits_semaphore_used"),
        sa.CheckConstraint("capacity >= 1", name="ck_permits_semaphore_capacity"),
        **_TABLE_OPTIONS,
    )
    op.create_table(
        "permits_lease",
        _id(),
        _name("owner"),
        _name("lease_key"),
        sa.Column("state", sa.SmallInteger(), nullable=False),
        sa.Column("end_reason", sa.String(16), nullable=True),
        _ms("acquired_at_ms"),
        _ms("expires_at_ms"),
        _ms("ended_at_ms", nullable=True),
        sa.UniqueConstraint("owner", "lease_key", name="uq_permits_lease_owner_key"),
        **_TABLE_OPTIONS,
    )
    # The sweep and the reclaim look for held leases by expiry; cleanup finds old ended ones.
    op.create_index("ix_permits_lease_state_expires", "permits_lease", ["state", "expires_at_ms"])
    op.create_index("ix_permits_lease_ended", "permits_lease", ["ended_at_ms"])
    op.create_table(
        "permits_permit",
        sa.Column("lease_id", sa.BigInteger(), nullable=False),
        sa.Column("semaphore_id", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("lease_id", "semaphore_id", name="pk_permits_permit"),
        # The database itself refuses a fencing token handed out twice for one semaphore.
        sa.UniqueConstraint("semaphore_id", "token", name="uq_permits_permit_token"),
        **_TABLE_OPTIONS,
    )
    op.create_table(
        "permits_capacity_change",
        _id(),
        _name("name"),
        sa.Column("old_capacity", sa.BigInteger(), nullable=True),
        sa.Column("new_capacity", sa.BigInteger(), nullable=False),
        sa.Column("changed_by", sa.String(255), nullable=False),
        sa.Column("reason", sa.String(1000), nullable=False),
        _ms("changed_at_ms"),
        **_TABLE_OPTIONS,
    )
    op.create_index("ix_permits_capacity_change_name", "permits_capacity_change", ["name", "changed_at_ms"])
    op.create_index("ix_permits_capacity_change_at", "permits_capacity_change", ["changed_at_ms"])


def downgrade() -> None:
    op.drop_table("permits_capacity_change")
    op.drop_table("permits_permit")
    op.drop_table("permits_lease")
    op.drop_table("permits_semaphore")
