"""The versioned schema: Alembic migrations shipped inside the package, run on a connection we own.

Several processes may start at once on a new database (the embedded default upgrades on first use), so
an upgrade runs under a lock and re-reads the version inside it: SQLite's write lock (the store opens the
transaction with BEGIN IMMEDIATE), a transaction-scoped advisory lock on PostgreSQL, GET_LOCK on MySQL.

Alembic is imported only to upgrade, or to read a revision that is not this version's head: a process that
opens a store on an up-to-date schema (every `permits run`, say) does not pay for importing it, about a
third of its start-up (docs/benchmarks.md, "Start-up").
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, inspect, text

from permits._exceptions import SchemaMismatch

if TYPE_CHECKING:
    from alembic.config import Config

VERSION_TABLE = "permits_alembic_version"
#: the newest revision in migrations/versions, the one this version of permits needs (a test checks it
#: against Alembic's reading of the directory)
HEAD = "0010"
_MIGRATIONS = Path(__file__).with_name("migrations")
_LOCK_ID = 0x7065726D697473  # "permits"


def _config(connection: Connection | None = None) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def head() -> str:
    """The revision this version of permits needs."""
    return HEAD


@functools.cache
def newer_than_this_code(revision: str | None) -> bool:
    """The database is at a revision this version of permits does not know: a newer permits upgraded it.
    Neither this version's statements nor its migrations can be used on it."""
    if revision is None or revision == HEAD:
        return False
    from alembic.script import ScriptDirectory
    from alembic.script.revision import ResolutionError
    from alembic.util import CommandError

    try:
        return ScriptDirectory.from_config(_config()).get_revision(revision) is None
    except (ResolutionError, CommandError):  # Alembic wraps the first in the second
        return True


def newer_schema(where: str, revision: str) -> SchemaMismatch:
    return SchemaMismatch(
        f"the permits schema at {where} is at revision {revision}, newer than this version of permits knows"
        f" (its newest is {head()}): upgrade permits here",
        url=where,
        revision=revision,
        head=head(),
    )


def outdated(where: str, revision: str | None) -> SchemaMismatch:
    """The error for a schema this version cannot use until it is upgraded: missing, or older."""
    if revision is None:
        return SchemaMismatch(f"no permits tables at {where}: run `permits db upgrade`", url=where)
    return SchemaMismatch(
        f"the permits schema at {where} is at revision {revision}; this version needs {head()}."
        " Run `permits db upgrade`",
        url=where,
        revision=revision,
        head=head(),
    )


def current(connection: Connection) -> str | None:
    """The revision the database is at, or None for a database permits has never touched."""
    # What Alembic's MigrationContext.get_current_revision reads, without importing Alembic: the version
    # table's one row, or nothing where permits never made the table.
    if not inspect(connection).has_table(VERSION_TABLE):
        return None
    revisions = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    if len(revisions) > 1:  # several heads: not a table permits writes; let Alembic say what is wrong
        from alembic.runtime.migration import MigrationContext

        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()
    return str(revisions[0]) if revisions else None


def upgrade(connection: Connection, where: str | None = None) -> str:
    """Bring the schema to the head revision; safe to run from several processes at once. Raises
    SchemaMismatch for a schema newer than this code, naming the database as ``where`` (the URL as the
    client shows it, see Settings.shown_url), or else as the engine's URL without its password."""
    backend = connection.dialect.name
    if backend == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _LOCK_ID})
    elif backend == "mysql":
        connection.execute(text("SELECT GET_LOCK('permits_schema_upgrade', 60)"))
    try:
        revision = current(connection)
        if newer_than_this_code(revision):
            # Alembic would fail to find the revision; downgrading a schema that newer clients use is not
            # ours to do either.
            assert revision is not None
            raise newer_schema(where or connection.engine.url.render_as_string(hide_password=True), revision)
        if revision != head():
            from alembic import command

            command.upgrade(_config(connection), "head")
    finally:
        if backend == "mysql":
            connection.execute(text("SELECT RELEASE_LOCK('permits_schema_upgrade')"))
    return head()
