"""PostgreSQL's one-statement grant and release as server functions, for clients behind a transaction pooler.

Behind a transaction pooler (PgBouncer's ``pool_mode = transaction``) a client cannot prepare statements on
the server: its next transaction may run on another server connection, which has never seen them. Sent
unprepared, the grant and the release are parsed and planned at every call, and planning these CTEs costs
more than running them (docs/benchmarks.md, "PostgreSQL behind PgBouncer"). PL/pgSQL keeps the plans of a
function's statements for the life of each server session, whoever calls it; so behind a transaction pooler
permits calls functions made from those two statements instead.

Each function is made from the dialect's own statement, so its SQL is written once, and it is named after a
hash of its definition: a definition never changes under a name. Clients of two versions of permits, or a
test that moved the server's clock, each call the functions of their own statements; a function no version
calls any more is left in place, unused (docs/deployment.md, "Poolers").
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from permits.dialects.base import Dialect

#: The statements made into functions: each one's parameters and SQL types, and its result columns. Only
#: statements that run alone (one request, one transaction) qualify: a function call is one statement.
CALLED_STATEMENTS: dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]] = {
    "ACQUIRE_ONE": (
        (("owner", "text"), ("key", "text"), ("name", "text"), ("count", "bigint"), ("ttl_ms", "bigint")),
        (("lease_id", "bigint"), ("acquired_at_ms", "bigint"), ("expires_at_ms", "bigint"), ("token", "bigint")),
    ),
    "RELEASE": (
        (("owner", "text"), ("key", "text")),
        (("notified", "text"),),
    ),
}

#: What a client finds of each function, before it calls them: ``missing``; ``callable``; ``denied`` (the
#: role may not execute it); or ``foreign``: a function of that name and arguments whose body, result or
#: settings are not the ones permits makes (anybody who may create in the schema could have put it there
#: first, since the names are no secret), which is never called.
#: params: signatures, sources, results (arrays, one item per function) -> one state per function, in order
PROBE = """
    SELECT CASE
        WHEN p.oid IS NULL THEN 'missing'
        WHEN p.prosrc <> f.source OR pg_get_function_result(p.oid) <> f.result OR p.prosecdef
             OR p.proconfig IS NOT NULL OR l.lanname <> 'plpgsql' THEN 'foreign'
        WHEN has_function_privilege(p.oid, 'EXECUTE') THEN 'callable'
        ELSE 'denied' END
    FROM unnest(CAST(:signatures AS TEXT[]), CAST(:sources AS TEXT[]), CAST(:results AS TEXT[]))
        WITH ORDINALITY AS f(signature, source, result, n)
    LEFT JOIN pg_proc p ON p.oid = to_regprocedure(f.signature)
    LEFT JOIN pg_language l ON l.oid = p.prolang
    ORDER BY f.n"""

#: SQLSTATEs of a CREATE FUNCTION that another client's CREATE of the same function beat (duplicate_function;
#: unique_violation on pg_proc, when both ran at once)
CREATED_MEANWHILE = {"42723", "23505"}
#: read_only_sql_transaction: a server that takes no writes (a standby)
READ_ONLY = "25006"
#: SQLSTATEs of a CREATE FUNCTION that this role cannot make here: insufficient_privilege, or a standby
MAY_NOT_CREATE = {"42501", READ_ONLY}

#: A bound parameter in a statement's text, as SQLAlchemy's ``text()`` finds them (``::`` casts excluded).
_BIND = re.compile(r"(?<![:\w\\]):(\w+)(?!:)")


@dataclass(frozen=True)
class ServerFunction:
    statement: str  #: the dialect statement it replaces
    name: str  #: the function's name, with the hash of its definition
    signature: str  #: name and argument types, as ``to_regprocedure`` reads them
    definition: str  #: the CREATE FUNCTION statement
    source: str  #: its body, as ``pg_proc.prosrc`` keeps it
    result: str  #: its result, as ``pg_get_function_result`` shows it
    call: str  #: the statement that calls it, with the replaced statement's bound parameters


def server_functions(dialect: Dialect) -> list[ServerFunction]:
    """The functions for ``dialect``'s hot statements, as it renders them (its clock included)."""
    return [_function(dialect, statement) for statement in CALLED_STATEMENTS]


def _function(dialect: Dialect, statement: str) -> ServerFunction:
    params, columns = CALLED_STATEMENTS[statement]
    body = dialect.sql(statement)
    used = set(_BIND.findall(body))
    declared = {param for param, _ in params}
    if used != declared:  # a statement changed its parameters without this table: fail loudly, in tests
        raise AssertionError(f"{statement} binds {sorted(used)}, but its function declares {sorted(declared)}")
    # Arguments and result columns get prefixes of their own, so that neither can be read as a column of
    # the statement's tables (PL/pgSQL would otherwise refuse the ambiguity at the first call).
    body = _BIND.sub(lambda bound: f"arg_{bound.group(1)}", body)
    arguments = ", ".join(f"arg_{param} {sql_type}" for param, sql_type in params)
    returns = ", ".join(f"out_{column} {sql_type}" for column, sql_type in columns)
    source = f"\nBEGIN\nRETURN QUERY {body};\nEND\n"
    shape = f"({arguments}) RETURNS TABLE ({returns}) LANGUAGE plpgsql AS $permits${source}$permits$"
    digest = hashlib.sha256(shape.encode()).hexdigest()[:16]
    name = f"permits_{statement.lower()}_{digest}"
    types = ", ".join(sql_type for _, sql_type in params)
    casts = ", ".join(f"CAST(:{param} AS {sql_type})" for param, sql_type in params)
    return ServerFunction(
        statement=statement,
        name=name,
        signature=f"{name}({types})",
        definition=f"CREATE FUNCTION {name}{shape}",
        source=source,
        result=f"TABLE({returns})",
        call=f"SELECT * FROM {name}({casts})",
    )
