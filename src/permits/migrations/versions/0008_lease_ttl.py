"""A lease keeps its TTL.

``permits_lease.ttl_ms``: the TTL the lease was granted with. An extend that names no TTL renews the lease
by this one, so ``client.extend(lease)`` keeps a lease acquired for 300 seconds at 300 seconds, whichever
client or service instance sends it; an extend that names one changes the expiry, not this. Leases granted
before this revision have none (NULL); an extend without a TTL gives them the extending client's default
TTL, as every extend without a TTL did before.

Revision ID: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default: an instant change on MariaDB 10.3+ and PostgreSQL 11+, and
    # on SQLite a change of the table's definition only.
    op.add_column("permits_lease", sa.Column("ttl_ms", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("permits_lease", "ttl_ms")
