"""Leases record a note on how they ended: an administrator's reason for a revoke, or what the
maintenance task found (owner dead, lease too old).

Revision ID: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable with no default: adding it is a metadata-only change on every backend, so the upgrade
    # takes no long lock on a large lease table.
    op.add_column("permits_lease", sa.Column("end_note", sa.String(1000), nullable=True))


def downgrade() -> None:
    op.drop_column("permits_lease", "end_note")
