"""Alembic environment: permits always hands Alembic an open connection (see permits/_schema.py)."""

from alembic import context

from permits._schema import VERSION_TABLE

connection = context.config.attributes["connection"]
context.configure(connection=connection, version_table=VERSION_TABLE, transaction_per_migration=False)
with context.begin_transaction():
    context.run_migrations()
