"""The server functions a client behind a transaction pooler calls (dialects/pg_functions.py): made from the
dialect's statements, named by their definition. Running them is tested against a real PostgreSQL in
tests/poolers/test_pgbouncer.py and by the model (tests/conformance/test_model.py)."""

from __future__ import annotations

import re
from typing import ClassVar

import pytest

from permits.dialects import pg_functions
from permits.dialects.pg_functions import CALLED_STATEMENTS, server_functions
from permits.dialects.postgresql import PostgreSQL

BIND = re.compile(r"(?<![:\w]):(\w+)")


def test_each_function_is_its_statement_and_its_call_binds_the_same_parameters() -> None:
    dialect = PostgreSQL()
    functions = server_functions(dialect)
    assert [f.statement for f in functions] == list(CALLED_STATEMENTS)
    for function in functions:
        statement = dialect.sql(function.statement)
        renamed = BIND.sub(r"arg_\1", statement)
        assert f"RETURN QUERY {renamed};" in function.definition
        assert set(BIND.findall(function.call)) == set(BIND.findall(statement))
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
    before, after = server_functions(PostgreSQL())[1], server_functions(Changed())[1]
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
