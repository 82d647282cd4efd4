"""Releases notify only while somebody listens.

``permits_semaphore.listened_until_ms``: until this time on the database's clock, some process LISTENs on
the semaphore's channel (PostgreSQL). A listener sets it while it is subscribed, and a release or a
give-back calls ``pg_notify`` only before it. A NOTIFY is not free even when nobody hears it: the
transaction that sends it holds PostgreSQL's one notification-queue lock from before its commit to after
it, so every notifying commit on the server (in any database) waits for the one before to reach the disk
(docs/benchmarks.md). Other engines leave the column at 0.

Revision ID: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A column with a constant default: an instant change on MariaDB 10.3+ and PostgreSQL 11+.
    op.add_column(
        "permits_semaphore", sa.Column("listened_until_ms", sa.BigInteger(), nullable=False, server_default="0")
    )


def downgrade() -> None:
    op.drop_column("permits_semaphore", "listened_until_ms")
