"""PostgreSQL's one-statement grant and release as server functions: behind a transaction pooler, and for
waiters that queue in the server's lock queue.

Behind a transaction pooler (PgBouncer's ``pool_mode = transaction``) a client cannot prepare statements on
the server: its next transaction may run on another server connection, which has never seen them. Sent
unprepared, the grant and the release are parsed and planned at every call, and planning these CTEs costs
more than running them (docs/benchmarks.md, "PostgreSQL behind PgBouncer"). PL/pgSQL keeps the plans of a
function's statements for the life of each server session, whoever calls it; so behind a transaction pooler
permits calls functions made from those two statements instead.

Each function is made from the dialect's own statement, so its SQL is written once, and it is named after a
hash of its definition: a definition never changes under a name. Clients of two versions of permits, or a
test that moved the server's clock, each call the functions of their own statements; a function no version
calls any more is left in place, unused, until ``permits db drop-old-functions`` (``OLD_FUNCTIONS``) drops it
(docs/deployment.md, "Server functions").

**Queued grants.** On a hot semaphore most waiters are refused, and how they wait decides the throughput.
``ACQUIRE_ONE_QUEUED`` is the grant behind a transaction-level advisory lock of the semaphore, its line: a
waiter sleeps in PostgreSQL's lock queue until the waiters ahead of it have been served, then runs
``ACQUIRE_ONE`` with the count as their commits left it, and at the head of the line it waits a little for
room (``QUEUED_STATEMENTS``). The queue costs nothing while they wait, and hands the turn on in order, with
no wake-up message (docs/design.md, "Waiters queue in the server's lock queue"). Releases never take this
lock, so they never queue behind waiters. The lock only orders attempts: capacity is still the conditional
UPDATE's, and a lock lost or shared (two names whose hashes collide) changes no outcome. Only a function
can queue this way in one round trip: the lock must be held before the grant statement starts, and until
its commit.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from permits.dialects.base import Dialect

#: The statements made into functions: each one's parameters and SQL types, and its result columns. Only
#: statements that run alone (one request, one transaction) qualify: a function call is one statement.
CALLED_STATEMENTS: dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]] = {
    "ACQUIRE_ONE": (
        (
            ("owner", "text"),
            ("key", "text"),
            ("name", "text"),
            ("count", "bigint"),
            ("ttl_ms", "bigint"),
            ("request_id", "text"),
            ("lock_wait_ms", "bigint"),
        ),
        (("lease_id", "bigint"), ("acquired_at_ms", "bigint"), ("expires_at_ms", "bigint"), ("token", "bigint")),
    ),
    "ACQUIRE_MANY": (
        (
            ("owner", "text"),
            ("key", "text"),
            ("names", "text[]"),
            ("counts", "bigint[]"),
            ("ttl_ms", "bigint"),
            ("request_id", "text"),
            ("lock_wait_ms", "bigint"),
        ),
        (
            ("lease_id", "bigint"),
            ("acquired_at_ms", "bigint"),
            ("expires_at_ms", "bigint"),
            ("name", "text"),
            ("token", "bigint"),
        ),
    ),
    "RELEASE": (
        (("owner", "text"), ("key", "text")),
        (("notified", "text"),),
    ),
    "RELEASE_ONE": (
        (("owner", "text"), ("key", "text")),
        (("notified", "text"),),
    ),
}
#: The queued grant: the statement it runs, its parameters beyond that statement's, and its body around the
#: statement (``{grant}``). It takes the semaphore's line lock, then grants as the statement does. Refused
#: at the head of the line, it stays there and asks again every 1 ms and then every 2 ms (``pg_sleep``
#: sleeps whole milliseconds), for up to ``head_ms``: a waiter keeps its place until room comes, and one
#: who released and asks again queues behind it. ``wait_ms`` bounds the whole call, the wait in the line
#: included (as its ``lock_timeout``, for the line and then for the grant's row lock, with what is left):
#: a caller whose time runs out in the line is refused, not failed; one whose turn came asks at least once,
#: even with no time left (a caller with none at all is not sent to the line). Under a ``statement_timeout`` (a role's
#: or a pooler's) the call keeps to half of it, so that waiting is never cancelled into an error.
#: It stops at the first refusal where waiting at the head cannot help: a deleted or missing semaphore, or
#: more permits than its capacity. On a fair semaphore a live place in the fair queue ahead of the caller
#: (an arrival in the line usually has no place yet, and then every place is ahead of it) keeps the room
#: for that waiter, who waits in its own queue and is called by the release that makes room for it; the
#: head waits on meanwhile, and each time fewer of the places that were ahead of it at its first refusal
#: remain (one was served, or given up), its ``head_ms`` starts again, within the call's time. So the line
#: waits for the queue ahead of it to be served and then takes over again; the head leaves when that queue
#: does not move for ``head_ms`` (a larger request that waits for permits held long), or when it has been
#: served and places taken since, by requests that do not use the line, still hold the room (``head_ms``
#: after the last of the places it found). Two earlier designs made the fair queue, once it had a waiter,
#: take in every later arrival for as long as arrivals came: each grant then took a refused call, a place,
#: a wake-up call and another attempt. The head stopped at the first refusal on every fair
#: semaphore (64 processes did about half of what they did with the head waiting:
#: docs/benchmarks/earlier-runs.md, "The head of the line on a fair semaphore"); then it stopped as soon as
#: a place was ahead of it, so that one head whose ``head_ms`` ran out behind a slow holder started the same
#: cascade (six processes on a fair mutex held 20 ms, all stopped for 0.2 s twice: 1.95 attempts per grant,
#: half of them outside the line; test_server_line.py). While the fair queue
#: is empty the line alone keeps the order, and the head waits for room as on a plain semaphore.
#: It counts live places by ``{now}``, the call's start, as the fair gate of its grant does.
#: Each attempt runs in a block of its own, rolled back when refused: an attempt that waited for the
#: semaphore row's lock behind another grant and then found no room keeps that lock (PostgreSQL re-checks
#: the row after the wait, and locks it either way), and the releases it waits for would wait behind it
#: until it gave up. On a fair semaphore, whose queued waiters are called to ask outside the line, that
#: is no rare case.
#: Outside READ COMMITTED (a role's ``default_transaction_isolation``) the
#: statement's snapshot would be older than the wait, so it grants once, without the line.
#:
#: The lock is the two-key form of the advisory lock: PostgreSQL keeps it apart from the one-key (bigint)
#: form, which applications use most. The first key marks permits' locks (the letters "perm").
LINE_LOCK_KEY = 1885696621
#: What the queued grants share: the call's time (``wait_ms``), kept to half of any statement_timeout; outside
#: READ COMMITTED, the grant once and no line; and that time as the lock timeout of the wait in the line.
_LINE_DECLARED = """
DECLARE
    budget interval := arg_wait_ms * interval '1 millisecond';
    statement_limit interval := CAST(current_setting('statement_timeout') AS interval);
    ends timestamptz;"""
_LINE_BUDGET = """
BEGIN
IF current_setting('transaction_isolation') <> 'read committed' THEN
    RETURN QUERY {grant};
    RETURN;
END IF;
IF statement_limit > interval '0' THEN
    budget := LEAST(budget, statement_limit / 2);
END IF;
ends := clock_timestamp() + budget;
PERFORM set_config('lock_timeout', CAST(GREATEST(CEIL(EXTRACT(EPOCH FROM budget) * 1000), 1) AS text), true);"""
#: Once the turn in the line has come: what is left of the time, as the lock timeout of the grant's row locks.
_LINE_REST = """
PERFORM set_config('lock_timeout',
    CAST(GREATEST(CEIL(EXTRACT(EPOCH FROM ends - clock_timestamp()) * 1000), 1) AS text), true);"""
#: The end of a wait at the head of the line, once the first refusal found it worth waiting: ask again after
#: 1 ms, then every 2 ms.
_HEAD_PACE = """        checked := true;
        PERFORM pg_sleep(0.001);
    ELSE
        PERFORM pg_sleep(0.002);
    END IF;
END LOOP;
END
"""
#: The live places in the fair queues of the semaphores ``names_match`` picks (``s``) that are ahead of the
#: caller's own (a caller without one is behind them all), counted by the call's start as the fair gate of
#: its grant counts them (``FAIR_GATE``, dialects/base.py).
_PLACES_AHEAD = """FROM permits_waiter w JOIN permits_semaphore s ON s.id = w.semaphore_id
            WHERE {names_match} AND s.fair = 1 AND w.expires_at_ms > {{now}}
              AND w.ticket < COALESCE(
                  (SELECT m.ticket FROM permits_waiter m
                   WHERE m.semaphore_id = s.id AND m.owner = arg_owner AND m.lease_key = arg_key),
                  9223372036854775807)"""
#: After a refusal on a fair semaphore: has the queue ahead of the head moved since its last refusal? Only
#: the places that were ahead at its first refusal count (``horizon``, their largest ticket): places taken
#: since then are served after the head's turn runs out (the gate keeps the room for them, and the head
#: then takes a place behind them), so that a queue that keeps getting new places, from requests that do
#: not use the line, cannot hold the line for the whole call. Fewer than at the last refusal: one of them
#: was served, or given up, and the wait at the head starts again (see QUEUED_STATEMENTS).
_FAIR_QUEUE_MOVED = (
    """IF last_ahead IS NULL THEN
            SELECT COUNT(*), MAX(w.ticket) INTO places_ahead, horizon
            PLACES_AHEAD;
        ELSE
            SELECT COUNT(*) INTO places_ahead
            PLACES_AHEAD
              AND w.ticket <= horizon;
        END IF;
        IF places_ahead < last_ahead THEN
            until := LEAST(clock_timestamp() + arg_head_ms * interval '1 millisecond', ends);
        END IF;
        last_ahead := places_ahead;"""
).replace("PLACES_AHEAD", _PLACES_AHEAD)
#: The turn in the line has come: ask until granted or ``head_ms`` is over, each attempt in a block of its
#: own, rolled back when refused, so that a refused attempt keeps no row lock while the head waits (see
#: QUEUED_STATEMENTS); what follows a refusal, and the pace, are each grant's own.
_HEAD_ATTEMPTS = """until := LEAST(clock_timestamp() + arg_head_ms * interval '1 millisecond', ends);
LOOP
    BEGIN
        RETURN QUERY {grant};
        IF FOUND THEN
            RETURN;
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'raise_exception';
    EXCEPTION WHEN raise_exception THEN
        NULL;
    END;
    IF clock_timestamp() >= until THEN
        RETURN;
    END IF;"""
QUEUED_STATEMENTS = {
    "ACQUIRE_ONE_QUEUED": (
        "ACQUIRE_ONE",
        (("wait_ms", "bigint"), ("head_ms", "bigint")),
        f"""{_LINE_DECLARED}
    until timestamptz;
    places_ahead bigint;
    last_ahead bigint;
    horizon bigint;
    fair_semaphore boolean;
    checked boolean := false;{_LINE_BUDGET}
BEGIN
    PERFORM pg_advisory_xact_lock({LINE_LOCK_KEY}, hashtext(arg_name));
EXCEPTION WHEN lock_not_available THEN
    RETURN;
END;{_LINE_REST}
{_HEAD_ATTEMPTS}
    IF NOT checked THEN
        SELECT fair = 1 INTO fair_semaphore FROM permits_semaphore
        WHERE name = arg_name AND deleted = 0 AND arg_count <= capacity;
        IF NOT FOUND THEN
            RETURN;
        END IF;
    END IF;
    IF fair_semaphore THEN
        {_FAIR_QUEUE_MOVED.format(names_match="s.name = arg_name")}
    END IF;
    IF NOT checked THEN
{_HEAD_PACE}""",
    ),
    # The same for several semaphores: it waits in the line of the first of them, in the order of the lock
    # keys, and takes the others' lines only if they are free (as LINES_ENTER does, dialects/postgresql.py),
    # so that it waits in one line only and holds none while it waits. At the head it waits for room as
    # above, and for the fair queues of those that are fair to move: without that, a refused head left the
    # line, and a process that had just released took the next turn (Jain 0.75-0.84 for 8 processes,
    # test_server_line.py). Each attempt runs in a block of its own, rolled back when refused, so that the
    # row locks a refused attempt may have taken (it saw room, then found none under the locks) are not held
    # while it waits.
    "ACQUIRE_MANY_QUEUED": (
        "ACQUIRE_MANY",
        (("wait_ms", "bigint"), ("head_ms", "bigint")),
        f"""{_LINE_DECLARED}
    until timestamptz;
    places_ahead bigint;
    last_ahead bigint;
    horizon bigint;
    checked boolean := false;
    fitting integer;
    any_fair boolean;
    first_line integer;{_LINE_BUDGET}
SELECT MIN(hashtext(n)) INTO first_line FROM unnest(arg_names) AS n;
BEGIN
    PERFORM pg_advisory_xact_lock({LINE_LOCK_KEY}, first_line);
EXCEPTION WHEN lock_not_available THEN
    RETURN;
END;
PERFORM pg_try_advisory_xact_lock({LINE_LOCK_KEY}, h)
FROM (SELECT DISTINCT hashtext(n) AS h FROM unnest(arg_names) AS n) AS lines
WHERE h <> first_line;{_LINE_REST}
{_HEAD_ATTEMPTS}
    IF NOT checked THEN
        SELECT COUNT(*), COALESCE(bool_or(s.fair = 1), false) INTO fitting, any_fair FROM permits_semaphore s
            JOIN unnest(arg_names, arg_counts) AS w (name, count) ON w.name = s.name
            WHERE s.deleted = 0 AND w.count <= s.capacity;
        IF fitting < cardinality(arg_names) THEN
            RETURN;
        END IF;
    END IF;
    IF any_fair THEN
        {_FAIR_QUEUE_MOVED.format(names_match="s.name = ANY(arg_names)")}
    END IF;
    IF NOT checked THEN
{_HEAD_PACE}""",
    ),
}
#: Behind a transaction pooler, every statement above is called as a function; otherwise only the queued
#: grant, which exists only as a function.
POOLED_FUNCTIONS = (*CALLED_STATEMENTS, *QUEUED_STATEMENTS)
DIRECT_FUNCTIONS = tuple(QUEUED_STATEMENTS)

#: What a client finds of each function, before it calls them: ``missing``; ``callable``; ``denied`` (the
#: role may not execute it); or ``foreign``, never called: a function of that name and arguments whose body,
#: result or settings are not the ones permits makes, or whose owner could change it into another (anybody
#: who may create in the schema could have put it there first, since the names are no secret). A trusted
#: owner is the role itself, the owner of permits' tables, or a superuser: only they can replace the body.
#: (Not any role the client's is a member of: to a superuser client, every role would pass. And a test that
#: cannot tell, a NULL, counts as untrusted.)
#: params: signatures, sources, results (arrays, one item per function) -> one row per function, in order:
#: its state, and the schema it is in (quoted as an identifier; NULL if missing)
PROBE = """
    SELECT CASE
        WHEN p.oid IS NULL THEN 'missing'
        WHEN p.prosrc <> f.source OR pg_get_function_result(p.oid) <> f.result OR p.prosecdef
             OR p.proconfig IS NOT NULL OR l.lanname <> 'plpgsql' THEN 'foreign'
        WHEN (p.proowner = (SELECT oid FROM pg_roles WHERE rolname = current_user) OR o.rolsuper
              OR p.proowner = (SELECT relowner FROM pg_class WHERE oid = to_regclass('permits_semaphore')))
             IS NOT TRUE THEN 'foreign'
        WHEN has_function_privilege(p.oid, 'EXECUTE') THEN 'callable'
        ELSE 'denied' END,
        quote_ident(n.nspname)
    FROM unnest(CAST(:signatures AS TEXT[]), CAST(:sources AS TEXT[]), CAST(:results AS TEXT[]))
        WITH ORDINALITY AS f(signature, source, result, n)
    LEFT JOIN pg_proc p ON p.oid = to_regprocedure(f.signature)
    LEFT JOIN pg_language l ON l.oid = p.prolang
    LEFT JOIN pg_roles o ON o.oid = p.proowner
    LEFT JOIN pg_namespace n ON n.oid = p.pronamespace
    ORDER BY f.n"""

#: permits' functions of any version, by name: what ``_function`` names them, hash included
FUNCTION_NAME_PATTERN = "^permits_(" + "|".join(name.lower() for name in POOLED_FUNCTIONS) + ")_[0-9a-f]{16}$"
#: The functions of other versions of permits (or made under a moved test clock) that this role may drop:
#: in a schema of its search_path, owned by a role whose privileges it has (``USAGE``: a member that does
#: not inherit them may not drop), and none of ``current`` (names). Procedures of such a name are not ours.
#: params: pattern, current -> the function as DROP FUNCTION takes it (schema-qualified, with its argument
#: types), one row per function
OLD_FUNCTIONS = """
    SELECT CAST(quote_ident(n.nspname) || '.' || quote_ident(p.proname) || '('
                || pg_get_function_identity_arguments(p.oid) || ')' AS TEXT)
    FROM pg_proc p
    JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE p.proname ~ :pattern
        AND n.nspname = ANY(current_schemas(false))
        AND p.prokind = 'f'
        AND pg_has_role(current_user, p.proowner, 'USAGE')
        AND NOT (p.proname = ANY(CAST(:current AS TEXT[])))
    ORDER BY 1"""

#: SQLSTATEs of a CREATE FUNCTION that another client's CREATE of the same function beat (duplicate_function;
#: unique_violation on pg_proc, when both ran at once)
CREATED_MEANWHILE = {"42723", "23505"}
#: SQLSTATEs of a call of a server function that cannot work any more: undefined_function (dropped since the
#: client checked), invalid_schema_name (its schema dropped), insufficient_privilege (EXECUTE revoked since),
#: feature_not_supported (the queued grant, on an engine that speaks PostgreSQL's protocol without advisory
#: locks). The first three must name the function or its schema (``function_gone``): the same codes from the
#: statement inside (a table the role may not write) are the statement's own failure, and would fail it too.
FUNCTION_GONE = {"42883", "3F000", "42501", "0A000"}
_CALLED = re.compile(r"FROM (.+)\.(permits_\w+)\(")


def function_gone(error: object, call: str) -> bool:
    """Whether ``error`` (the driver's exception) says that the server function that ``call`` calls cannot
    work any more, rather than that its statement failed: see ``FUNCTION_GONE``."""
    state = getattr(error, "sqlstate", None)
    if state not in FUNCTION_GONE:
        return False
    if state == "0A000":
        return True
    called = _CALLED.search(call)
    if called is None:  # pragma: no cover - every call is made by ServerFunction.call_in
        return False
    schema, name = called.group(1).replace("\\:", ":").strip('"'), called.group(2)
    diag = getattr(error, "diag", None)
    message = (getattr(diag, "message_primary", None) or str(error)) if diag is not None else str(error)
    return name in message or (state == "3F000" and schema in message)


#: SQLSTATEs of the grant that asks outside the line (``ACQUIRE_ONE_LINE_FREE``) on an engine without
#: PostgreSQL's advisory locks: feature_not_supported, or undefined_function (``pg_try_advisory_xact_lock``)
LINE_UNSUPPORTED = {"0A000", "42883"}


def line_unsupported(error: object) -> bool:
    """Whether ``error`` (the driver's exception) from ``ACQUIRE_ONE_LINE_FREE`` says that this engine has
    no advisory locks, and so no line."""
    return getattr(error, "sqlstate", None) in LINE_UNSUPPORTED


#: read_only_sql_transaction: a server that takes no writes (a standby)
READ_ONLY = "25006"
#: SQLSTATEs of a CREATE FUNCTION that this role cannot make here: insufficient_privilege, or a standby
MAY_NOT_CREATE = {"42501", READ_ONLY}

#: A bound parameter in a statement's text, as SQLAlchemy's ``text()`` finds them (``::`` casts excluded).
_BIND = re.compile(r"(?<![:\w\\]):(\w+)(?!:)")


@dataclass(frozen=True)
class ServerFunction:
    statement: str  #: the dialect statement it replaces (or, for a queued grant, the one it adds)
    made_from: str  #: the dialect statement its body runs
    name: str  #: the function's name, with the hash of its definition
    signature: str  #: name and argument types, as ``to_regprocedure`` reads them
    definition: str  #: the CREATE FUNCTION statement
    source: str  #: its body, as ``pg_proc.prosrc`` keeps it
    result: str  #: its result, as ``pg_get_function_result`` shows it
    arguments: str  #: the call's arguments: the replaced statement's bound parameters, cast

    @property
    def call(self) -> str:
        """The statement that calls it, found through the ``search_path``."""
        return f"SELECT * FROM {self.name}({self.arguments})"

    def call_in(self, schema: str) -> str:
        """The statement that calls the function in ``schema`` (an identifier, quoted as needed), the one the
        probe found and checked: a function of the same name that appears later in a schema earlier on the
        ``search_path`` is never called in its place."""
        # A colon in a quoted schema name would read as a bound parameter to SQLAlchemy's text().
        escaped = schema.replace(":", "\\:")
        return f"SELECT * FROM {escaped}.{self.name}({self.arguments})"


def server_functions(dialect: Dialect, names: Sequence[str] = POOLED_FUNCTIONS) -> list[ServerFunction]:
    """The functions ``names`` for ``dialect``, made from its statements as it renders them (its clock
    included)."""
    return [_function(dialect, name) for name in names]


def _function(dialect: Dialect, name: str) -> ServerFunction:
    statement, extra, around = QUEUED_STATEMENTS.get(name, (name, (), "\nBEGIN\nRETURN QUERY {grant};\nEND\n"))
    params, columns = CALLED_STATEMENTS[statement]
    body = dialect.sql(statement)
    used = set(_BIND.findall(body))
    declared = {param for param, _ in params}
    if used != declared:  # a statement changed its parameters without this table: fail loudly, in tests
        raise AssertionError(f"{statement} binds {sorted(used)}, but its function declares {sorted(declared)}")
    # Arguments and result columns get prefixes of their own, so that neither can be read as a column of
    # the statement's tables (PL/pgSQL would otherwise refuse the ambiguity at the first call).
    body = _BIND.sub(lambda bound: f"arg_{bound.group(1)}", body)
    params = (*params, *extra)
    arguments = ", ".join(f"arg_{param} {sql_type}" for param, sql_type in params)
    returns = ", ".join(f"out_{column} {sql_type}" for column, sql_type in columns)
    source = around.replace("{grant}", body).replace("{now}", dialect.now)
    shape = f"({arguments}) RETURNS TABLE ({returns}) LANGUAGE plpgsql AS $permits${source}$permits$"
    digest = hashlib.sha256(shape.encode()).hexdigest()[:16]
    function = f"permits_{name.lower()}_{digest}"
    types = ", ".join(sql_type for _, sql_type in params)
    casts = ", ".join(f"CAST(:{param} AS {sql_type})" for param, sql_type in params)
    return ServerFunction(
        statement=name,
        made_from=statement,
        name=function,
        signature=f"{function}({types})",
        definition=f"CREATE FUNCTION {function}{shape}",
        source=source,
        result=f"TABLE({returns})",
        arguments=casts,
    )
