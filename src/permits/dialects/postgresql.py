"""PostgreSQL, through psycopg 3 (one driver for sync and async)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from permits.dialects.base import (
    IDLE_IN_TRANSACTION_SECONDS,
    PORTABLE_SQL,
    Dialect,
    Fault,
    SettingFix,
    require_module,
    row_has_room,
)
from permits.dialects.pg_functions import LINE_LOCK_KEY

_CONFLICT = {
    "40001",  # serialization_failure
    "40P01",  # deadlock_detected
    "55P03",  # lock_not_available: lock_timeout passed
}
_UNAVAILABLE_PREFIXES = ("08",)  # connection_exception
_UNAVAILABLE = {
    "57P01",  # admin_shutdown
    "57P02",  # crash_shutdown
    "57P03",  # cannot_connect_now: starting up, or a standby being promoted
    "57P05",  # idle_session_timeout: the server ended a session left idle (a parked one, say)
    "25P03",  # idle_in_transaction_session_timeout: the server ended the session, its transaction undone
    "53300",  # too_many_connections
    # statement_completion_unknown (CockroachDB): the commit may or may not have happened. Retrying is
    # safe because every write is idempotent: the retry finds the grant under its key, or makes it.
    "40003",
}
_READ_ONLY = {"25006"}  # read_only_sql_transaction: a hot standby
_DUPLICATE = {"23505"}  # unique_violation
_SCHEMA = {"42P01"}  # undefined_table
#: What the server says when it refuses a connection for its credentials (28P01, 28000), which libpq reports
#: as a failed connection with no SQLSTATE: not retried, as MariaDB's 1045 and 1698 are not (each retry
#: would count as a failed login where the server or a proxy in front of it counts them), and not waited
#: through as an outage. In English, the server's default: a server that answers in another language is
#: retried, as any failed connection.
_REFUSED_LOGIN = (
    "authentication failed",
    "no pg_hba.conf entry",
    "pg_hba.conf rejects connection",
    "is not permitted to log in",
    "permission denied for database",
    "does not have CONNECT privilege",
    "unsupported startup parameter",  # PgBouncer before 1.20, given options it does not take (?pooler=)
)


def _notify_while_listened(rows: str) -> str:
    """The first half of a statement that makes room: one row per semaphore in ``rows`` (a CTE with its
    name and listened_until_ms), which notifies the semaphore's channel only while a listener marks it as
    listened to (see LISTENED_MARK). The row comes back either way: RELEASE's rows say what it gave back.
    Its column is cast to text (``pg_notify`` returns void) so that the statement can be a function's
    result too (pg_functions.py)."""
    return (
        "SELECT CAST(CASE WHEN listened_until_ms > {now} THEN pg_notify('permits_room_' || md5(name), name) END"
        f" AS TEXT) FROM {rows}"
    )


def _call_fitting(rows: str, leaving: str = "") -> str:
    """The second half of a statement that makes room: notify the wake channel of each waiter in a fair
    queue that fits now, given ``rows`` (a CTE with the semaphores' id, name, room and fair). A waiter fits
    when its count and those of the live waiters ahead of it fit in the room, as the fair gate of
    ``SEM_TAKE`` counts them; ``leaving`` excludes the places a statement deletes itself (a statement does
    not see its own CTE's changes)."""
    return (
        """
            UNION ALL
            SELECT CAST(pg_notify(w.wake_channel, r.name) AS TEXT)
            FROM """
        + rows
        + """ r, LATERAL (
                SELECT q.wake_channel, SUM(q.count) OVER (ORDER BY q.ticket) AS upto
                FROM permits_waiter q
                WHERE q.semaphore_id = r.id AND q.expires_at_ms > {now}"""
        + leaving
        + """) w
            WHERE r.fair = 1 AND w.upto <= r.room AND w.wake_channel IS NOT NULL"""
    )


#: How often a running statement's server checks that its client is still connected (PostgreSQL 14+).
CLIENT_CHECK_MS = 1000

#: The session settings whose absence matters behind a transaction pooler, in SESSION_TIMEOUTS' order. (The
#: one more permits makes, timezone, changes nothing: every time permits keeps is epoch milliseconds.) The
#: last exists from PostgreSQL 14 only: before, the server shows none (NULL), and there is nothing to set.
_POOLED_SETTINGS = ("lock_timeout", "idle_in_transaction_session_timeout", "client_connection_check_interval")


def _session_settings(lock_wait_timeout: float) -> list[tuple[str, str]]:
    """What every session of permits sets. A client frozen or cut off inside a transaction would keep its
    row locks until TCP gives up: the server ends such a session after IDLE_IN_TRANSACTION_SECONDS
    instead, and a wait for a row lock fails after ``lock_wait_timeout`` into the retry loop."""
    return [
        ("lock_timeout", str(max(1, round(lock_wait_timeout * 1000)))),
        ("idle_in_transaction_session_timeout", str(IDLE_IN_TRANSACTION_SECONDS * 1000)),
        ("timezone", "UTC"),
    ]


# A grant's wait for a semaphore row's lock (another transaction holds it: a grant over several semaphores, a
# change of capacity, a forgotten transaction in a SQL console) lasts no longer than the caller's time
# (lock_wait_ms; NULL: the session's lock_timeout, as for a try that does not wait). The condition is checked
# on each row the statement reads, before it takes the row's lock, so set_config sets the statement's own
# transaction's lock_timeout before the statement can wait (0 would mean no bound: never below 1 ms). It lasts
# to the end of the transaction: in autocommit, the statement's own.
_LOCK_WAIT_BOUND = """
                AND (CAST(:lock_wait_ms AS BIGINT) IS NULL OR set_config(
                    'lock_timeout', CAST(GREATEST(CAST(:lock_wait_ms AS BIGINT), 1) AS TEXT), true) IS NOT NULL)"""
# Acquire one semaphore in one statement: each CTE feeds the next, so when the UPDATE finds no room
# nothing is inserted and no row comes back. The lease is stamped once the semaphore's row is
# locked (RETURNING runs on the updated row), not when the statement started: a grant that waited
# for the row still gets its whole TTL, and it is stamped after the commit of the release or grant
# it waited for, as a grant over several semaphores (ACQUIRE_MANY) is. A grant also gives up
# the request's places in fair queues (a waiting caller may hold some).
# params: owner, key, name, count, ttl_ms, request_id, lock_wait_ms
# -> lease id, acquired_at_ms, expires_at_ms, token (no row: no room, or no such semaphore)
_ACQUIRE_ONE = f"""
            WITH taken AS (
                UPDATE permits_semaphore
                SET used = used + :count, last_token = last_token + 1, updated_at_ms = {{clock_now}}
                WHERE name = :name AND deleted = 0 AND used + :count <= capacity{{fair_gate}}{_LOCK_WAIT_BOUND}
                RETURNING id, last_token, {{clock_now}} AS granted_ms),
            lease AS (
                INSERT INTO permits_lease (
                    owner, lease_key, state, acquired_at_ms, expires_at_ms, ttl_ms, request_id)
                SELECT :owner, :key, 1, granted_ms, granted_ms + :ttl_ms, :ttl_ms, :request_id FROM taken
                RETURNING id, acquired_at_ms, expires_at_ms),
            permit AS (
                INSERT INTO permits_permit (lease_id, semaphore_id, count, token)
                SELECT lease.id, taken.id, :count, taken.last_token FROM lease, taken
                RETURNING token),
            placed AS (
                DELETE FROM permits_waiter
                WHERE owner = :owner AND lease_key = :key AND EXISTS (SELECT 1 FROM lease))
            SELECT lease.id, lease.acquired_at_ms, lease.expires_at_ms, permit.token FROM lease, permit"""
#: ACQUIRE_ONE for a caller that would otherwise ask in the semaphore's line (``ACQUIRE_ONE_QUEUED``, see
#: pg_functions.py), granted only while nobody is in that line: it takes the line's lock if it is free, and
#: holds it to its commit, so that it passes no waiter there. Without the queued grant's function (PL/pgSQL,
#: the line's lock, two set_config calls), an uncontended grant costs less (docs/benchmarks.md, "Asking
#: outside an empty line"). No row: the line was busy, or there was no room; either way the caller then asks in
#: the line, where the head waits a little for room. As in the queued grant, a wait for the semaphore row's
#: lock lasts no longer than the caller's time (``wait_ms``, which never exceeds ``lock_wait_timeout``): the
#: statement sets its own transaction's ``lock_timeout`` before it can wait. params: ACQUIRE_ONE's, wait_ms
_ACQUIRE_ONE_LINE_FREE = _ACQUIRE_ONE.replace(
    "{fair_gate}",
    "{fair_gate}"
    f"\n                AND pg_try_advisory_xact_lock({LINE_LOCK_KEY}, hashtext(:name))"
    "\n                AND set_config('lock_timeout', CAST(GREATEST(:wait_ms, 1) AS TEXT), true) IS NOT NULL",
    1,
)


class PostgreSQL(Dialect):
    name = "postgresql"
    # statement_timestamp(): the time the statement started, the same everywhere in one statement.
    now_sql = "CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000 AS BIGINT)"
    # clock_timestamp(): the time as the expression is evaluated, after any row lock the statement waited for.
    clock_now_sql = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)"
    sync_driver = "psycopg"
    async_driver = "psycopg"
    extra = "postgresql"
    # psycopg's autocommit is a client-side switch, and a transaction costs a BEGIN round trip of its own.
    free_autocommit = True
    # SQLAlchemy's work per statement was most of the client's CPU per operation: see docs/design.md
    statements_on_driver = True
    # Tickets come from one sequence for every semaphore (TICKET_NEXT); ``is_called`` false: its
    # ``last_value`` is the next one, not yet handed out.
    ticket_counter = "(SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM permits_ticket)"
    overrides: ClassVar[dict[str, str | None]] = {
        # A server session whose link the reply deadline cut (see the store's ``_end_cut_sessions``): a pid
        # is reused once its backend exits, so a session is told by its pid and start, and its server by
        # when the server started (a primary and its standby, or a restarted server, differ there).
        # -> id (the pid), started, server
        "SESSION_OF": """
            SELECT pid AS id, backend_start AS started, pg_postmaster_start_time() AS server
            FROM pg_stat_activity WHERE pid = pg_backend_pid()""",
        # params: SESSION_OF's row -> same_server, alive. (pg_stat_activity is read once per transaction:
        # each look must be a transaction of its own.)
        "SESSION_FIND": """
            SELECT pg_postmaster_start_time() = :server AS same_server,
                   EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = :id AND backend_start = :started) AS alive""",
        # The backend ends its transaction and exits; the request its link held then meets a closed
        # connection. params: id, started
        "SESSION_END": """
            SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = :id AND backend_start = :started""",
        # Release in one statement: the CTE ends the lease and the outer UPDATE gives back the permits of
        # each of its semaphores (one permit row per semaphore, so each semaphore row is matched once).
        # Waiters LISTEN on their semaphores' channels (see _async/listener.py): each statement that gives
        # permits back notifies the semaphore's channel while a listener has marked it as listened to
        # (listened_until_ms, migration 0006), and calls the waiters in fair queues that fit now on their
        # own channels; PostgreSQL sends the notifications at commit. An unheard NOTIFY is not free: its
        # commit waits for every other notifying commit on the server (see LISTENED_MARK).
        # ``locked`` takes the semaphore rows in name order, the order every grant takes them in: an UPDATE
        # locks rows in the order its plan reads them (with an index plan, semaphore-id order), and a
        # release and a grant over the same semaphores, made out of name order, then deadlocked, which
        # PostgreSQL breaks only after deadlock_timeout (tests/concurrency/test_lock_order.py). A lease over
        # one semaphore has no order to keep: RELEASE_ONE. params: owner, key
        # -> at least one row per semaphore given back (none: nothing was held under this key)
        "RELEASE": """
            WITH ended AS (
                UPDATE permits_lease SET state = 0, end_reason = 'released', ended_at_ms = {now}
                WHERE owner = :owner AND lease_key = :key AND state = 1 AND expires_at_ms > {now}
                RETURNING id),
            locked AS MATERIALIZED (
                SELECT s.id, p.count
                FROM ended e
                JOIN permits_permit p ON p.lease_id = e.id
                JOIN permits_semaphore s ON s.id = p.semaphore_id
                ORDER BY s.name
                FOR NO KEY UPDATE OF s),
            given AS (
                UPDATE permits_semaphore s SET used = s.used - l.count, updated_at_ms = {now}
                FROM locked l
                WHERE s.id = l.id
                RETURNING s.id, s.name, s.capacity - s.used AS room, s.fair, s.listened_until_ms)
            """
        + _notify_while_listened("given")
        + _call_fitting("given"),
        # RELEASE for a lease the caller knows to be over one semaphore: it locks one semaphore row, so it can
        # wait on no grant in a cycle, and it skips RELEASE's locking step (about 4% of the cost of the two
        # statements of a cycle, benchmarks/statement_cost.py). Given a lease over several, it still gives all
        # of them back, in the order its plan reads them. params: owner, key -> as RELEASE
        "RELEASE_ONE": """
            WITH ended AS (
                UPDATE permits_lease SET state = 0, end_reason = 'released', ended_at_ms = {now}
                WHERE owner = :owner AND lease_key = :key AND state = 1 AND expires_at_ms > {now}
                RETURNING id),
            given AS (
                UPDATE permits_semaphore s SET used = s.used - p.count, updated_at_ms = {now}
                FROM permits_permit p, ended e
                WHERE p.lease_id = e.id AND s.id = p.semaphore_id
                RETURNING s.id, s.name, s.capacity - s.used AS room, s.fair, s.listened_until_ms)
            """
        + _notify_while_listened("given")
        + _call_fitting("given"),
        "SEM_GIVE_BACK": """
            WITH given AS (
                UPDATE permits_semaphore SET used = used - :count, updated_at_ms = {now} WHERE id = :id
                RETURNING id, name, capacity - used AS room, fair, listened_until_ms)
            """
        + _notify_while_listened("given")
        + _call_fitting("given"),
        "SEM_SET_CAPACITY": """
            WITH changed AS (
                UPDATE permits_semaphore SET capacity = :capacity, updated_at_ms = {now} WHERE id = :id
                RETURNING id, name, capacity - used AS room, fair)
            SELECT CAST(pg_notify('permits_room_' || md5(name), name) AS TEXT) FROM changed"""
        + _call_fitting("changed"),
        "ACQUIRE_ONE": _ACQUIRE_ONE,
        "ACQUIRE_ONE_LINE_FREE": _ACQUIRE_ONE_LINE_FREE,
        # Acquire several semaphores in one statement, all or none. ``seen`` reads, without a lock, whether
        # every semaphore exists and has room: when the snapshot already says no, nothing is locked, and the
        # refusal waits for no row (a refused request must not hold, nor queue for, the rows the next grant
        # needs). Otherwise ``locked`` takes the rows' locks in name order (the order every grant takes them
        # in: two grants never wait on each other in a cycle) and reads them as they are under the lock;
        # ``fits`` says whether every one of them has room, the fair gate included, so the UPDATE writes
        # either all of them or none. The rest is ACQUIRE_ONE's, once per semaphore: the lease is stamped
        # once the rows are locked, so a grant that waited for a row still gets its whole TTL. One round trip,
        # where the grant a statement per step took a round trip per semaphore with the rows locked across
        # them. Its wait for the rows' locks is bounded as ACQUIRE_ONE's. params: owner, key, names, counts
        # (arrays, in name order, no name twice), ttl_ms, request_id, lock_wait_ms -> lease id, acquired_at_ms,
        # expires_at_ms, name, token: a row per semaphore (none: no room in one of them, or one does not exist)
        "ACQUIRE_MANY": """
            WITH wanted AS (
                SELECT w.name, w.count
                FROM unnest(CAST(:names AS TEXT[]), CAST(:counts AS BIGINT[])) AS w (name, count)),
            seen AS (
                SELECT COUNT(*) = cardinality(CAST(:names AS TEXT[]))
                       AND COALESCE(bool_and(s.used + w.count <= s.capacity), false) AS ok
                FROM permits_semaphore s JOIN wanted w ON w.name = s.name
                WHERE s.deleted = 0),
            locked AS MATERIALIZED (
                SELECT s.id, s.name, s.capacity, s.used, s.fair, w.count
                FROM permits_semaphore s JOIN wanted w ON w.name = s.name
                WHERE s.deleted = 0 AND (SELECT ok FROM seen)"""
        + _LOCK_WAIT_BOUND
        + """
                ORDER BY s.name
                FOR NO KEY UPDATE OF s),
            fits AS (
                SELECT COUNT(*) = cardinality(CAST(:names AS TEXT[])) AND COALESCE(bool_and(
                    """
        + row_has_room("l", "l.count")
        + """), false) AS ok
                FROM locked l),
            taken AS (
                UPDATE permits_semaphore s
                SET used = s.used + l.count, last_token = s.last_token + 1, updated_at_ms = {clock_now}
                FROM locked l, fits
                WHERE s.id = l.id AND fits.ok
                RETURNING s.id, l.name, l.count, s.last_token, {clock_now} AS granted_ms),
            lease AS (
                INSERT INTO permits_lease (
                    owner, lease_key, state, acquired_at_ms, expires_at_ms, ttl_ms, request_id)
                SELECT :owner, :key, 1, MAX(granted_ms), MAX(granted_ms) + :ttl_ms, :ttl_ms, :request_id FROM taken
                HAVING COUNT(*) > 0
                RETURNING id, acquired_at_ms, expires_at_ms),
            permit AS (
                INSERT INTO permits_permit (lease_id, semaphore_id, count, token)
                SELECT lease.id, taken.id, taken.count, taken.last_token FROM lease, taken),
            placed AS (
                DELETE FROM permits_waiter
                WHERE owner = :owner AND lease_key = :key AND EXISTS (SELECT 1 FROM lease))
            SELECT lease.id, lease.acquired_at_ms, lease.expires_at_ms, CAST(taken.name AS TEXT), taken.last_token
            FROM lease, taken""",
        # Group commit, for the service's lines (server/handoff.py): one statement and one commit for what
        # a semaphore's line has gathered since its last turn, the releases of leases over that semaphore
        # alone and the waiting requests for one permit of it. The releases end their leases first (lease
        # rows, then the semaphore's row, the order of every release); then, under the row's lock, the
        # requests are granted in the order given, as many as the room left by those releases allows, and the
        # row is written once: its count less what came back and plus what was granted, its token counter
        # moved on by the number granted. The grant is conditional on the row as it is written (the CASE), so
        # capacity is still checked by the database as the row is written, and the number granted is read
        # back from the counter. The row's WHERE names it by id alone: an UPDATE checks its WHERE against the
        # row as its snapshot has it before it looks at the latest version, and a count there would have
        # skipped the write (releases included) whenever a release committed between the statement's start
        # and its lock (tests/faults: test_turns_under_faults found the drift). The k-th request granted gets
        # the k-th of the new tokens. A fair semaphore takes no
        # part: its queue decides who goes first, and its releases call the waiters that fit (RELEASE); nor
        # does a lease that holds permits of another semaphore too. Those are released alone by their
        # callers, and the requests ask alone. A key that has a lease already
        # fails the whole statement (unique_violation), and everything in it is then asked alone, which
        # answers a retry from its lease. Permits that come back and are not handed over notify as RELEASE's
        # do. params: name, gone_owners, gone_keys (the releases), owners, keys, ttls (the requests; arrays,
        # one item each) -> kind, owner, key, acquired_at_ms, expires_at_ms, token: kind 1, a request granted;
        # 2, a lease released; 3, one row with the semaphore's room once the turn is done in the place of
        # ``acquired_at_ms`` and its fair flag in that of ``token`` (both NULL: no such semaphore); 4, the
        # notifications' own
        "HAND_OVER": """
            WITH ended AS (
                UPDATE permits_lease l SET state = 0, end_reason = 'released', ended_at_ms = {now}
                FROM unnest(CAST(:gone_owners AS TEXT[]), CAST(:gone_keys AS TEXT[])) AS g (owner, lease_key)
                WHERE l.owner = g.owner AND l.lease_key = g.lease_key AND l.state = 1 AND l.expires_at_ms > {now}
                    AND NOT EXISTS (
                        SELECT 1 FROM permits_permit p JOIN permits_semaphore o ON o.id = p.semaphore_id
                        WHERE p.lease_id = l.id AND (o.name <> :name OR o.fair <> 0))
                RETURNING l.id, l.owner, l.lease_key),
            returned AS (
                SELECT COALESCE(SUM(p.count), 0) AS n FROM ended e JOIN permits_permit p ON p.lease_id = e.id),
            locked AS MATERIALIZED (
                SELECT s.id, s.last_token, r.n, CASE WHEN s.fair = 0 AND s.deleted = 0
                    THEN LEAST(GREATEST(s.capacity - s.used + r.n, 0), cardinality(CAST(:keys AS TEXT[])))
                    ELSE 0 END AS k
                FROM permits_semaphore s, returned r
                WHERE s.name = :name
                FOR NO KEY UPDATE OF s),
            taken AS (
                UPDATE permits_semaphore s
                SET used = s.used - l.n + CASE WHEN s.used - l.n + l.k <= s.capacity THEN l.k ELSE 0 END,
                    last_token = s.last_token + CASE WHEN s.used - l.n + l.k <= s.capacity THEN l.k ELSE 0 END,
                    updated_at_ms = {clock_now}
                FROM locked l
                WHERE s.id = l.id AND (l.n > 0 OR l.k > 0)
                RETURNING s.id, s.name, l.last_token AS before, s.last_token - l.last_token AS k, l.n,
                    {clock_now} AS granted_ms, s.capacity - s.used AS room, s.fair, s.listened_until_ms),
            asked AS (
                SELECT a.owner, a.lease_key, a.ttl_ms, a.place
                FROM unnest(CAST(:owners AS TEXT[]), CAST(:keys AS TEXT[]), CAST(:ttls AS BIGINT[]))
                    WITH ORDINALITY AS a (owner, lease_key, ttl_ms, place)),
            granted AS (
                SELECT a.owner, a.lease_key, a.ttl_ms, t.id AS semaphore_id, t.before + a.place AS token, t.granted_ms
                FROM asked a, taken t
                WHERE a.place <= t.k),
            lease AS (
                INSERT INTO permits_lease (owner, lease_key, state, acquired_at_ms, expires_at_ms, ttl_ms)
                SELECT owner, lease_key, 1, granted_ms, granted_ms + ttl_ms, ttl_ms FROM granted
                RETURNING id, owner, lease_key, acquired_at_ms, expires_at_ms),
            permit AS (
                INSERT INTO permits_permit (lease_id, semaphore_id, count, token)
                SELECT l.id, g.semaphore_id, 1, g.token
                FROM lease l JOIN granted g ON g.owner = l.owner AND g.lease_key = l.lease_key
                RETURNING lease_id, token),
            freed AS (
                SELECT id, name, room, fair, listened_until_ms FROM taken WHERE n > 0 AND room > 0)
            SELECT 1, l.owner, l.lease_key, l.acquired_at_ms, l.expires_at_ms, p.token
            FROM lease l JOIN permit p ON p.lease_id = l.id
            UNION ALL
            SELECT 2, e.owner, e.lease_key, NULL, NULL, NULL FROM ended e
            UNION ALL
            SELECT 3, NULL, NULL, COALESCE((SELECT room FROM taken), s.capacity - s.used), NULL, CAST(s.fair AS BIGINT)
            FROM (SELECT 1) AS one LEFT JOIN permits_semaphore s ON s.name = :name AND s.deleted = 0
            UNION ALL
            SELECT 4, NULL, n.note, NULL, NULL, NULL FROM ("""
        + _notify_while_listened("freed")
        + """) AS n (note)""",
        # REFUSAL_READ with the names as one array parameter: the statement then goes to the driver as it
        # is, alone (see Stmt.alone), rather than through SQLAlchemy's expansion of ``IN :names``.
        "REFUSAL_READ": PORTABLE_SQL["REFUSAL_READ"].replace("IN :names", "= ANY(:names)"),
        # A waiter that gives up its place (its wait timed out) may leave room for the ones behind it: call
        # those that fit now, and notify the semaphore's channel while it is listened to (as RELEASE does).
        # params: owner, key -> one row per semaphore whose queue it left
        "WAITERS_DELETE": """
            WITH gone AS (
                DELETE FROM permits_waiter WHERE owner = :owner AND lease_key = :key RETURNING semaphore_id),
            left_behind AS (
                SELECT id, name, capacity - used AS room, fair, listened_until_ms FROM permits_semaphore
                WHERE id IN (SELECT semaphore_id FROM gone))
            """
        + _notify_while_listened("left_behind")
        + _call_fitting("left_behind", " AND NOT (q.owner = :owner AND q.lease_key = :key)"),
        # Where a client could not make the queued grant over several semaphores (pg_functions.py), a grant
        # over several semaphores that waits takes its turn in the line of the first of them with this, in
        # the order of the lock keys (the lock the queued grants take), and takes the others' lines only if
        # they are free at that moment; then it grants (ACQUIRE_MANY) in the same transaction, and the commit
        # lets the lines go. So it waits in one line only, holding none: it never keeps another semaphore's
        # waiters behind it while it waits (as waiting in each line would: -32% for the single-semaphore
        # waiters of a mixed load, measured), and its wait is one lock wait, which lock_timeout bounds by
        # what is left of the caller's time, kept to half of a statement_timeout (which would cancel it into
        # an error). Requests for the same semaphores all wait in the same first line, so they take turns.
        # The lateral join runs the first set_config before the locks; the last one, once every lock is
        # taken or tried (it reads their count), gives the grant's row locks what the wait left. One
        # statement, one round trip. Outside READ COMMITTED it takes no lock: the transaction's snapshot,
        # taken as this statement starts, would be older than the wait, and its grant would then fail to
        # serialize (the queued grant does the same). params: wait_ms, names (distinct)
        "LINES_ENTER": f"""
            SELECT set_config('lock_timeout', CAST(GREATEST(1, 0 * held.n + limited.ms
                - CAST(EXTRACT(EPOCH FROM clock_timestamp() - statement_timestamp()) * 1000 AS bigint)) AS text),
                true)
            FROM (SELECT GREATEST(1, LEAST(:wait_ms, CASE
                    WHEN CAST(current_setting('statement_timeout') AS interval) > interval '0'
                    THEN CAST(EXTRACT(EPOCH FROM CAST(current_setting('statement_timeout') AS interval)) * 500
                              AS bigint)
                    ELSE :wait_ms END)) AS ms) AS limited,
            LATERAL (
                SELECT count(*) AS n FROM (
                    SELECT CASE WHEN k.first
                        THEN (SELECT true FROM (SELECT pg_advisory_xact_lock({LINE_LOCK_KEY}, k.h)) AS waited)
                        ELSE pg_try_advisory_xact_lock({LINE_LOCK_KEY}, k.h) END AS taken
                    FROM (SELECT set_config('lock_timeout', CAST(limited.ms AS text), true) AS setting) AS bound,
                    LATERAL (
                        SELECT h, h = MIN(h) OVER () AS first FROM (
                            SELECT DISTINCT hashtext(n) AS h FROM unnest(CAST(:names AS TEXT[])) AS n
                            WHERE bound.setting IS NOT NULL
                                AND current_setting('transaction_isolation') = 'read committed') AS d
                        ORDER BY h) AS k) AS lines) AS held""",
        # A fair queue's ticket from a sequence (migration 0005), one per request for all its queues:
        # nextval locks no row, so an arriving waiter does not hold the semaphore row, which every grant
        # and release writes, through its enqueue and commit. -> ticket
        "TICKET_NEXT": "SELECT nextval('permits_ticket')",
        # The sequence raised to a ticket, only where it is behind it (setval is not undone by a rollback,
        # and no row lock orders it: a nextval between this statement's read and its set is below the
        # ticket, and stays handed out). params: id (unused: one sequence serves every semaphore), ticket
        "SEM_RAISE_TICKET": """
            SELECT setval('permits_ticket', CAST(:ticket AS BIGINT), true) FROM permits_ticket
            WHERE CAST(:id AS BIGINT) IS NOT NULL
                AND CASE WHEN is_called THEN last_value ELSE last_value - 1 END < CAST(:ticket AS BIGINT)""",
        # The enqueue in one statement (flows._enqueue does it in four elsewhere): keep the request's places
        # (and say where to call it now), or else take one ticket from the sequence for all of its fair
        # queues and a place in each; then how many permits it is short of fitting, per queue, as
        # WAITER_SHORT counts them. The last part reads the table as it was when the statement began, which
        # holds every waiter ahead of the request: a new place has the newest ticket, and a kept one does
        # not count itself. params: owner, key, place_ms, wake, sem_ids, counts (arrays, one item per fair
        # semaphore) -> short, one row per place
        "ENQUEUE": """
            WITH kept AS (
                UPDATE permits_waiter SET expires_at_ms = {now} + :place_ms, wake_channel = :wake
                WHERE owner = :owner AND lease_key = :key
                RETURNING semaphore_id, ticket, count),
            ticket AS (
                SELECT nextval('permits_ticket') AS ticket WHERE NOT EXISTS (SELECT 1 FROM kept)),
            placed AS (
                INSERT INTO permits_waiter
                    (semaphore_id, ticket, owner, lease_key, count, enqueued_at_ms, expires_at_ms, wake_channel)
                SELECT w.semaphore_id, t.ticket, :owner, :key, w.count, {now}, {now} + :place_ms, :wake
                FROM ticket t, unnest(CAST(:sem_ids AS BIGINT[]), CAST(:counts AS BIGINT[])) AS w(semaphore_id, count)
                RETURNING semaphore_id, ticket, count),
            mine AS (SELECT * FROM kept UNION ALL SELECT * FROM placed)
            SELECT s.used + m.count - s.capacity + COALESCE((
                SELECT SUM(w.count) FROM permits_waiter w
                WHERE w.semaphore_id = m.semaphore_id AND w.ticket < m.ticket AND w.expires_at_ms > {now}), 0)
            FROM mine m JOIN permits_semaphore s ON s.id = m.semaphore_id""",
        # A listener marks the semaphores it LISTENs for, so that their releases notify: a NOTIFY takes
        # PostgreSQL's one notification-queue lock before its transaction commits and keeps it till after,
        # so notifying commits reach the disk one at a time; a release nobody hears should not pay that.
        # A mark lasts mark_ms and is renewed only once less than half of it is left, so the many
        # listeners of a hot semaphore write its row about once per half mark between them. A row that
        # another transaction holds (a grant committing, a multi-semaphore acquire, a frozen client) is
        # skipped rather than waited for: the listener delivers nothing while it waits, and a wait here
        # could hold up that transaction in turn. params: names, mark_ms
        # -> the names still due: marked too long ago, and skipped because their row was locked
        "LISTENED_MARK": """
            WITH stale AS (
                SELECT id, name FROM permits_semaphore
                WHERE name = ANY(:names) AND deleted = 0 AND listened_until_ms < {now} + :mark_ms / 2),
            free AS (
                SELECT id FROM permits_semaphore WHERE id IN (SELECT id FROM stale)
                FOR NO KEY UPDATE SKIP LOCKED),
            marked AS (
                UPDATE permits_semaphore SET listened_until_ms = {now} + :mark_ms
                WHERE id IN (SELECT id FROM free)
                RETURNING id)
            SELECT name FROM stale WHERE id NOT IN (SELECT id FROM marked)""",
        # Behind a transaction pooler permits cannot make its session settings (see engine_options): the
        # role's or the database's own must do. -> one column per name of _POOLED_SETTINGS, as the server
        # shows it ('0': none; NULL: not on this server), then the role, quoted as an identifier (see
        # pooled_settings_fixes)
        "SESSION_TIMEOUTS": """
            SELECT current_setting('lock_timeout'), current_setting('idle_in_transaction_session_timeout'),
                   current_setting('client_connection_check_interval', true), quote_ident(current_user)""",
        # A setting's value tried for the rest of this transaction only (set_config's is_local), which the
        # caller rolls back: whether the server takes it. A server whose platform cannot watch for closed
        # sockets (Windows; on PostgreSQL 14 anything but Linux) refuses any client_connection_check_interval
        # but 0, with invalid_parameter_value. params: name, value
        "SETTING_TRY": "SELECT set_config(:name, :value, true)",
        "LEASE_END_ONE": None,
        "SEM_GIVE_BACK_LEASE": None,
    }

    def connect_within(self, cparams: dict[str, Any], seconds: float) -> dict[str, Any]:
        if "connect_timeout" not in cparams:
            return cparams
        # libpq's bound covers the whole connect, in whole seconds, and takes any value under 2 as 2.
        return {**cparams, "connect_timeout": min(int(cparams["connect_timeout"]), max(2, math.ceil(seconds)))}

    def engine_options(self, lock_wait_timeout: float, pooler: str | None = None) -> dict[str, Any]:
        if pooler is None:
            options = " ".join(f"-c {name}={value}" for name, value in _session_settings(lock_wait_timeout))
            return {"connect_args": {"options": options, "connect_timeout": 5}}
        # Behind a pooler the settings cannot ride in the startup packet: PgBouncer before 1.20 refuses
        # ``options`` there. A session pooler gets them at connect (on_connect_sql); behind a transaction
        # pooler only the role's own settings apply (the store checks them when it opens).
        connect_args: dict[str, Any] = {"connect_timeout": 5}
        if pooler == "transaction":
            # psycopg prepares a statement on the server after 5 runs by default; the pooler may send the next
            # run to another server connection, which does not know it ("prepared statement does not exist").
            connect_args["prepare_threshold"] = None
        return {"connect_args": connect_args}

    def pooled_settings_fixes(self, row: tuple[Any, ...], lock_wait_timeout: float) -> list[SettingFix]:
        *values, role = row
        # in milliseconds, the unit of each
        wanted = {
            **dict(_session_settings(lock_wait_timeout)),
            "client_connection_check_interval": str(CLIENT_CHECK_MS),
        }
        return [
            SettingFix(name, f"{wanted[name]}ms", f"ALTER ROLE {role} SET {name} = '{wanted[name]}ms';")
            for name, value in zip(_POOLED_SETTINGS, values, strict=True)
            if value is not None and str(value) == "0"
        ]

    def on_connect_sql(self, lock_wait_timeout: float, pooler: str | None = None) -> str | None:
        if pooler == "transaction":
            return None
        # A waiter in a semaphore's line (pg_functions.py) waits inside a statement: a client killed there
        # would be granted a lease it never sees, held until its TTL. From PostgreSQL 14 the server checks
        # that the client is still there while a statement runs, and ends the statement when it is not.
        # After connecting, and only where the server has it and allows it: in the startup packet it would
        # fail the connection to an older server, or to one whose platform cannot watch for a closed socket
        # (Windows), which refuses any value but 0.
        check = (
            "IF current_setting('server_version_num')::int >= 140000 THEN BEGIN"
            f" PERFORM set_config('client_connection_check_interval', '{CLIENT_CHECK_MS}', false);"
            " EXCEPTION WHEN invalid_parameter_value THEN NULL; END; END IF;"
        )
        settings = ""
        if pooler == "session":
            # A session pooler keeps the server connection for this client connection's life, and resets it
            # (DISCARD ALL) before the next client gets it, so the settings are this connection's alone.
            settings = " ".join(
                f"PERFORM set_config('{name}', '{value}', false);"
                for name, value in _session_settings(lock_wait_timeout)
            )
        return f"DO $permits$BEGIN {settings} {check} END$permits$"

    def check_driver(self, asynchronous: bool) -> None:
        require_module("psycopg", self.extra)

    def handshake_session(self, driver: Any) -> int | None:
        try:
            return int(driver.info.backend_pid)  # psycopg's Connection and AsyncConnection alike
        except Exception:
            return None

    def reply_socket(self, driver: Any) -> int | None:
        try:
            return int(driver.pgconn.socket)  # psycopg's Connection and AsyncConnection alike
        except Exception:  # closed, or not psycopg's: no deadline rather than no statement
            return None

    def _classify(self, orig: BaseException | None) -> Fault:
        state = getattr(orig, "sqlstate", None) or ""
        if state in _CONFLICT:
            return Fault.CONFLICT
        if state in _UNAVAILABLE or state.startswith(_UNAVAILABLE_PREFIXES):
            return Fault.UNAVAILABLE
        if state in _DUPLICATE:
            return Fault.DUPLICATE
        if state in _READ_ONLY:
            return Fault.READ_ONLY
        if state in _SCHEMA:
            return Fault.SCHEMA
        if not state and any(kind.__name__ == "OperationalError" for kind in type(orig).__mro__):
            if _refused_login(str(orig)):
                return Fault.OTHER
            # psycopg reports a refused or timed-out connection (ConnectionTimeout) with no SQLSTATE
            return Fault.UNAVAILABLE
        return Fault.OTHER


def _refused_login(message: str) -> bool:
    """Whether a failed connection's message is the server refusing the login (``_REFUSED_LOGIN``); a role
    that does not exist reads ``FATAL:  role "name" does not exist``."""
    if "fe_sendauth" in message:  # libpq's own: the server asked for a password, and none was given
        return True
    fatal = message.partition("FATAL:")[2]
    no_such_role = 'role "' in fatal and "does not exist" in fatal
    return no_such_role or any(words in fatal for words in _REFUSED_LOGIN)
