"""A lease records which request got it.

``permits_lease.request_id``: for a request for a new lease only (``new_only``), an id the client makes up
for the request and sends with each of its tries. The key may name another caller's lease (two hosts that
chose the same key), and a try whose reply was lost may have been granted: a retry that finds a lease under
its key knows it as its own by this id, and gets it back, where another request's is refused
(``KeyInUse``). NULL for every other lease, and for leases granted before this revision.

Revision ID: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default: an instant change on MariaDB 10.3+ and PostgreSQL 11+, and
    # on SQLite a change of the table's definition only.
    op.add_column("permits_lease", sa.Column("request_id", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("permits_lease", "request_id")
