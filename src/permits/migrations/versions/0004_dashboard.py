"""The dashboard's short-term history and the admin log. New tables only: nothing on the hot path changes.

- ``permits_stat``: one row per semaphore per sample (every ``dashboard.step`` seconds), written by the one
  service instance elected for the task: capacity, use, waiters, the fencing token (grants are its rise),
  and the hold times of the leases that ended since the sample before.
- ``permits_instance_stat``: what each service instance saw of a semaphore in a step: grants, refusals,
  timeouts, requests waiting, and a histogram of how long granted acquires waited. The page sums it over
  instances, so an instance's restart blanks nothing.
- ``permits_admin_log``: every admin action taken through the service, with who and why, written in the
  action's own transaction.

Revision ID: 0004
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_TABLE_OPTIONS: dict[str, Any] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}


def _exact_text_collation() -> str | None:
    bind = op.get_bind()
    if bind.dialect.name == "mysql":
        return "utf8mb4_nopad_bin" if getattr(bind.dialect, "is_mariadb", False) else "utf8mb4_0900_bin"
    if bind.dialect.name == "postgresql":
        return "C"
    return None


def _text(column: str, nullable: bool = False, length: int = 255) -> sa.Column[Any]:
    return sa.Column(column, sa.String(length, collation=_exact_text_collation()), nullable=nullable)


def _count(column: str, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(column, sa.BigInteger(), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "permits_stat",
        _text("name"),
        _count("bucket_ms"),
        _count("capacity"),
        _count("used"),
        _count("waiting"),
        _count("last_token"),
        _count("ended"),
        _count("hold_p50_ms", nullable=True),
        _count("hold_p99_ms", nullable=True),
        sa.PrimaryKeyConstraint("name", "bucket_ms", name="pk_permits_stat"),
        **_TABLE_OPTIONS,
    )
    op.create_index("ix_permits_stat_bucket", "permits_stat", ["bucket_ms"])
    op.create_table(
        "permits_instance_stat",
        sa.Column("instance", sa.String(32), nullable=False),
        _text("name"),
        _count("bucket_ms"),
        _count("granted"),
        _count("refused"),
        _count("timeouts"),
        _count("waiting"),
        sa.Column("wait_hist", sa.String(400), nullable=False),
        sa.PrimaryKeyConstraint("instance", "name", "bucket_ms", name="pk_permits_instance_stat"),
        **_TABLE_OPTIONS,
    )
    op.create_index("ix_permits_instance_stat_bucket", "permits_instance_stat", ["bucket_ms"])
    op.create_table(
        "permits_admin_log",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        _count("at_ms"),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        _text("name", nullable=True),
        _text("lease_owner", nullable=True),
        _text("lease_key", nullable=True),
        sa.Column("reason", sa.String(1000), nullable=False),
        sa.Column("detail", sa.String(1000), nullable=True),
        **_TABLE_OPTIONS,
    )
    op.create_index("ix_permits_admin_log_at", "permits_admin_log", ["at_ms"])
    op.create_index("ix_permits_admin_log_name", "permits_admin_log", ["name", "at_ms"])


def downgrade() -> None:
    op.drop_table("permits_admin_log")
    op.drop_table("permits_instance_stat")
    op.drop_table("permits_stat")
