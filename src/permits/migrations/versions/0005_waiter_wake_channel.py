"""Fair queues on PostgreSQL, made cheaper to wait in:

- a place records the waiter's wake channel (the LISTEN channel of the waiting process), which a release
  notifies when the waiter's turn comes (other engines leave it empty);
- tickets come from a sequence, ``permits_ticket``, one per request, instead of a counter on the semaphore
  row: taking one no longer locks the row that every grant and release of the semaphore writes.

Revision ID: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default: an instant change on MariaDB 10.3+ and PostgreSQL 11+.
    op.add_column("permits_waiter", sa.Column("wake_channel", sa.String(63), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        # Start past every ticket handed out so far, so that places taken before the upgrade stay ahead.
        op.execute("CREATE SEQUENCE permits_ticket")
        op.execute(
            "SELECT setval('permits_ticket', (SELECT COALESCE(MAX(last_ticket), 0) + 1 FROM permits_semaphore), false)"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # Carry the tickets on in the semaphore rows' counters, where the earlier revision takes them.
        op.execute("UPDATE permits_semaphore SET last_ticket = (SELECT last_value FROM permits_ticket)")
        op.execute("DROP SEQUENCE permits_ticket")
    op.drop_column("permits_waiter", "wake_channel")
