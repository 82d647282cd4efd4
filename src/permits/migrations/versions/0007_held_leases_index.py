"""Held leases get an index of their own (SQLite and PostgreSQL).

Held leases are few: at most the sum of the capacities, plus expired ones not yet swept. Ended ones are
the history, and grow until cleanup deletes them. Every read of held leases (the sweep, reclaims, holders,
the service's liveness and stale checks, its gauges) must find them without reading the history, whatever
the planner believes about it.

``ix_permits_lease_state_expires`` (state, expires_at_ms) did that only while the planner knew how few
leases are held. SQLite keeps no statistics unless someone runs ANALYZE, and with them it keeps one
average per index column: ``state`` then looks like a column with two values, each on half the rows, and
with 1,000,000 ended leases the planner scanned the lease table for a sweep, a reclaim or the held
owners. A partial index holds the held leases only: SQLite's statements name it (``held_index`` in
dialects/base.py), and with statistics SQLite and PostgreSQL see from it how few leases are held (without
them PostgreSQL still guesses: docs/deployment.md, "History and the planner"). A release writes no entry
in it, where it wrote one in the old index.

MariaDB has no partial indexes, and InnoDB estimates ``state = 1`` by reading the index itself: it keeps
the old index.

Revision ID: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

#: Engines with partial indexes.
PARTIAL = ("sqlite", "postgresql")
HELD = "state = 1"


def upgrade() -> None:
    if op.get_bind().dialect.name not in PARTIAL:
        return
    op.create_index(
        "ix_permits_lease_held",
        "permits_lease",
        ["expires_at_ms"],
        sqlite_where=sa.text(HELD),
        postgresql_where=sa.text(HELD),
    )
    op.drop_index("ix_permits_lease_state_expires", table_name="permits_lease")


def downgrade() -> None:
    if op.get_bind().dialect.name not in PARTIAL:
        return
    op.create_index("ix_permits_lease_state_expires", "permits_lease", ["state", "expires_at_ms"])
    op.drop_index("ix_permits_lease_held", table_name="permits_lease")
