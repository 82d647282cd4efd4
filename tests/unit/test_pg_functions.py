"""The server functions permits calls on PostgreSQL (dialects/pg_functions.py): made from the dialect's
statements, named by their definition. Running them is tested against a real PostgreSQL in
tests/poolers/test_pgbouncer.py and by the model (tests/conformance/test_model.py)."""

from __future__ import annotations

import re
from typing import ClassVar

import pytest

from permits.dialects import pg_functions
from permits.dialects.pg_functions import (
    CALLED_STATEMENTS,
    DIRECT_FUNCTIONS,
    POOLED_FUNCTIONS,
    QUEUED_STATEMENTS,
    server_functions,
)
from permits.dialects.postgresql import PostgreSQL

BIND = re.compile(r"(?<![:\w]):(\w+)")


def test_each_function_is_its_statement_and_its_call_binds_the_same_parameters() -> None:
    dialect = PostgreSQL()
    functions = server_functions(dialect)
    assert [f.statement for f in functions] == [*CALLED_STATEMENTS, *QUEUED_STATEMENTS]
    for function in functions:
        statement = dialect.sql(function.made_from)
        renamed = BIND.sub(r"arg_\1", statement)
        assert f"RETURN QUERY {renamed};" in function.definition
        extra = {param for param, _ in QUEUED_STATEMENTS.get(function.statement, ("", (), ""))[1]}
        assert set(BIND.findall(function.call)) == set(BIND.findall(statement)) | extra
        assert function.call.startswith(f"SELECT * FROM {function.name}(")
        assert function.signature.startswith(f"{function.name}(")


def test_a_changed_statement_gets_a_function_of_another_name() -> None:
    release = PostgreSQL.overrides["RELEASE"]
    assert release is not None

    class Changed(PostgreSQL):
        overrides: ClassVar[dict[str, str | None]] = {
            **PostgreSQL.overrides,
            "RELEASE": release.replace("ended_at_ms = {now}", "ended_at_ms = {now} + 0"),
        }

    assert server_functions(PostgreSQL()) == server_functions(PostgreSQL())
    before, after = server_functions(PostgreSQL(), ["RELEASE"])[0], server_functions(Changed(), ["RELEASE"])[0]
    assert before.statement == after.statement == "RELEASE"
    assert before.name != after.name


def test_a_statement_whose_parameters_changed_without_its_table_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    table = dict(CALLED_STATEMENTS)
    table["RELEASE"] = ((("owner", "text"),), table["RELEASE"][1])
    monkeypatch.setattr(pg_functions, "CALLED_STATEMENTS", table)
    with pytest.raises(AssertionError, match="RELEASE binds"):
        server_functions(PostgreSQL())


def test_replacing_statements_leaves_the_dialect_it_came_from_alone() -> None:
    dialect = PostgreSQL()
    calls = {f.statement: f.call for f in server_functions(dialect)}
    calling = dialect.with_statements(calls)
    assert calling.sql("ACQUIRE_ONE") == calls["ACQUIRE_ONE"]
    assert dialect.sql("ACQUIRE_ONE") != calls["ACQUIRE_ONE"]
    assert calling.sql("LEASE_EXTEND") == dialect.sql("LEASE_EXTEND")


def test_the_queued_grant_takes_its_semaphores_line_lock_before_the_grant_starts() -> None:
    """The lock must be held before the grant's statement takes its snapshot and reads the count, so that
    the attempt sees every commit of the waiters ahead of it in the line; and the grant is the plain one."""
    dialect = PostgreSQL()
    (queued,) = server_functions(dialect, ["ACQUIRE_ONE_QUEUED"])
    (plain,) = server_functions(dialect, ["ACQUIRE_ONE"])
    assert queued.statement == "ACQUIRE_ONE_QUEUED" and queued.made_from == "ACQUIRE_ONE"
    lock = "PERFORM pg_advisory_xact_lock(1885696621, hashtext(arg_name));"
    grant = plain.source.strip().removeprefix("BEGIN").removesuffix("END").strip()
    assert grant.startswith("RETURN QUERY WITH taken AS (")
    # once without the line (outside READ COMMITTED), then in it, after the lock
    first, in_line = (m.start() for m in re.finditer(re.escape(grant), queued.source))
    assert first < queued.source.index(lock) < in_line
    # the plain grant's arguments and two more, and the same result, so the flow reads either the same way
    more = ", bigint, bigint)"
    assert queued.signature.split("(", 1)[1] == plain.signature.split("(", 1)[1].replace(")", more)
    assert queued.result == plain.result
    assert queued.call.endswith(", CAST(:wait_ms AS bigint), CAST(:head_ms AS bigint))")


def test_the_queued_grant_over_several_semaphores_waits_in_the_first_line_then_tries_the_others() -> None:
    """Like the one-semaphore queued grant, it holds its line before the grant starts, and it waits in one line
    only: the first in lock-key order; the others it only tries (a wait in each would cost the caller's time
    once per line, and hold lines while it waits for another)."""
    dialect = PostgreSQL()
    (queued,) = server_functions(dialect, ["ACQUIRE_MANY_QUEUED"])
    (plain,) = server_functions(dialect, ["ACQUIRE_MANY"])
    assert queued.made_from == "ACQUIRE_MANY"
    grant = plain.source.strip().removeprefix("BEGIN").removesuffix("END").strip()
    first, in_line = (m.start() for m in re.finditer(re.escape(grant), queued.source))
    wait = queued.source.index("PERFORM pg_advisory_xact_lock(1885696621, first_line);")
    tries = queued.source.index("PERFORM pg_try_advisory_xact_lock(1885696621, h)")
    assert first < wait < tries < in_line
    assert queued.source.count("pg_advisory_xact_lock(") == 1
    # At the head, each attempt in a block of its own, rolled back when refused: it keeps no row lock.
    loop = queued.source[queued.source.index("LOOP") :]
    assert loop.index("BEGIN") < loop.index(grant) < loop.index("RAISE EXCEPTION") < loop.index("EXCEPTION WHEN")
    assert queued.result == plain.result
    assert queued.call.endswith(", CAST(:wait_ms AS bigint), CAST(:head_ms AS bigint))")


def test_only_the_queued_grants_are_made_for_clients_that_reach_the_server_directly() -> None:
    assert DIRECT_FUNCTIONS == ("ACQUIRE_ONE_QUEUED", "ACQUIRE_MANY_QUEUED")
    assert set(POOLED_FUNCTIONS) == {
        "ACQUIRE_ONE",
        "ACQUIRE_MANY",
        "RELEASE",
        "RELEASE_ONE",
        "ACQUIRE_ONE_QUEUED",
        "ACQUIRE_MANY_QUEUED",
    }


@pytest.mark.parametrize("schema", ["public", '"Mixed Case"', '"odd :name"'])
def test_a_call_names_the_schema_and_binds_only_the_statements_parameters(schema: str) -> None:
    """The schema comes quoted (``quote_ident``) from the probe; a colon in it must not read as a bound
    parameter when SQLAlchemy compiles the call."""
    from sqlalchemy import text

    queued = server_functions(PostgreSQL(), DIRECT_FUNCTIONS)[0]
    call = queued.call_in(schema)
    escaped = schema.replace(":", "\\:")  # text() reads a backslashed colon as the colon itself
    assert call.startswith(f"SELECT * FROM {escaped}.{queued.name}(")
    assert set(text(call).compile().params) == set(BIND.findall(queued.call))
