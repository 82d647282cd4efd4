"""MariaDB and MySQL (InnoDB), through PyMySQL and aiomysql."""

from __future__ import annotations

import asyncio
import math
from typing import Any, ClassVar

from permits._core.flows import Result
from permits.dialects.base import IDLE_IN_TRANSACTION_SECONDS, Dialect, Fault, require_module, row_has_room

# Error numbers, from the server (1xxx) and the client library (2xxx).
_CONFLICT = {
    1205,  # ER_LOCK_WAIT_TIMEOUT
    1213,  # ER_LOCK_DEADLOCK; also a Galera certification failure (and Vitess's deadlock)
    1614,  # ER_XA_RBDEADLOCK
    # ER_AUTOINC_READ_FAILED: InnoDB's answer when an INSERT ... SELECT (ACQUIRE_ONE's lease row) waits
    # for a table's AUTO-INC lock and loses: a deadlock victim or a lock wait timeout. The real
    # cause (1213, 1205) is not reported, and the statement or transaction is rolled back just the same.
    # innodb_autoinc_lock_mode = 2 (required by Galera, the default in MySQL 8) takes no such lock. The
    # other meaning, a BIGINT id at its maximum, cannot happen in practice.
    1467,
    3101,  # ER_TRANSACTION_ROLLBACK_DURING_COMMIT: MySQL Group Replication's certification failure
    8002,  # TiDB: SELECT ... FOR UPDATE met a write conflict (optimistic mode)
    8022,  # TiDB: the transaction's commit failed and is safe to retry
    8028,  # TiDB: the schema changed under the transaction
    9007,  # TiDB: write conflict (optimistic mode)
}
_UNAVAILABLE = {
    1040,  # ER_CON_COUNT_ERROR: too many connections
    # Refused at connect: no such database, or none this user may use. PostgreSQL's driver reports a
    # missing database as a failed connection too, so both engines raise StorageUnavailable for it. A wrong
    # password (1045, 1698) is not retried: each retry would count against max_password_errors (MariaDB)
    # or FAILED_LOGIN_ATTEMPTS (MySQL), and could lock the account for every client that shares it.
    1044,  # ER_DBACCESS_DENIED_ERROR
    1049,  # ER_BAD_DB_ERROR
    1047,  # ER_UNKNOWN_COM_ERROR: Galera node not ready ("WSREP has not yet prepared node")
    3100,  # ER_RUN_HOOK_ERROR: a Group Replication member that is not ONLINE (no quorum) refused a commit
    1053,  # ER_SERVER_SHUTDOWN
    1152,  # ER_ABORTING_CONNECTION
    1927,  # ER_CONNECTION_KILLED
    2002,  # CR_CONNECTION_ERROR
    2003,  # CR_CONN_HOST_ERROR
    2006,  # CR_SERVER_GONE_ERROR
    2013,  # CR_SERVER_LOST
    2055,  # CR_SERVER_LOST_EXTENDED
    4031,  # ER_CLIENT_INTERACTION_TIMEOUT
    9001,  # TiDB: PD server timeout
    9002,  # TiDB: TiKV server timeout
    9005,  # TiDB: region unavailable
}
_READ_ONLY = {
    1290,  # ER_OPTION_PREVENTS_STATEMENT: --read-only / --super-read-only
    1792,  # ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION
    1836,  # ER_READ_ONLY_MODE
}
_DUPLICATE = {1062}  # ER_DUP_ENTRY
# Client capability flags (pymysql.constants.CLIENT), spelled out so that this module loads without the
# driver. FOUND_ROWS makes an UPDATE report the rows it matched, as SQLAlchemy expects; MULTI_STATEMENTS
# lets one request carry a whole transaction (see ``self_committing``). Every value permits sends is a
# bound parameter that the driver escapes, so several statements per request add no injection risk.
_FOUND_ROWS = 2
_SERVER_STATUS_IN_TRANS = 1
_MULTI_STATEMENTS = 1 << 16
_SCHEMA = {1146}  # ER_NO_SUCH_TABLE


# Release: end the lease and give back each of its semaphores' permits, in one statement. A lease has one
# permit row per semaphore, so each semaphore row matches once (a multi-table UPDATE changes a row at most
# once, which is why batches use LEASES_END + SEM_GIVE_BACK instead). params: owner, key
_RELEASE_UPDATE = """
            UPDATE permits_lease l
            JOIN permits_permit p ON p.lease_id = l.id
            JOIN permits_semaphore s ON s.id = p.semaphore_id
            SET l.state = 0, l.end_reason = 'released', l.ended_at_ms = {now},
                s.used = s.used - p.count, s.updated_at_ms = {now}
            WHERE l.owner = :owner AND l.lease_key = :key AND l.state = 1 AND l.expires_at_ms > {now}"""


# The wants of a grant over several semaphores, from one JSON parameter (``[[name, count], ...]``, in name
# order), each joined to its semaphore's row through the unique index on its name, in that order: the rows
# are read, and so locked, in name order, the order every grant locks them in. STRAIGHT_JOIN and FORCE
# INDEX keep that plan whatever the table's statistics say (with few rows they chose a full scan, which
# locks every semaphore). The column has the name column's collation, or the index could not be used.
_WANTED_ROWS = """JSON_TABLE(:wants, '$[*]' COLUMNS (
                name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin PATH '$[0]',
                count BIGINT PATH '$[1]')) w
            STRAIGHT_JOIN permits_semaphore s FORCE INDEX (uq_permits_semaphore_name) ON s.name = w.name"""


# The requests and the releases of a line's turn (HAND_OVER), from JSON parameters: ``[[owner, key, ttl_ms],
# ...]`` in the order given (``place`` counts from 1), and ``[[owner, key], ...]``. Their columns have the
# lease columns' collation, so that the joins use the unique index on (owner, lease_key).
_ASKED = """JSON_TABLE(:asked, '$[*]' COLUMNS (
                place FOR ORDINALITY,
                owner VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin PATH '$[0]',
                lease_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin PATH '$[1]',
                ttl_ms BIGINT PATH '$[2]')) a"""
#: The ids of the leases a turn ends, as its locking read kept them.
_ENDED = """JSON_TABLE(COALESCE(@permits_gone, '[]'), '$[*]' COLUMNS (id BIGINT PATH '$')) j"""
_GONE = """JSON_TABLE(:gone, '$[*]' COLUMNS (
                owner VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin PATH '$[0]',
                lease_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin PATH '$[1]')) g"""


# ---- a server session whose link the reply deadline cut (see the store's ``_end_cut_sessions``)
#
# A connection id is unique while the server runs and starts over when it restarts, so a session is told by
# its id, the client address and port the server sees it from, the server (``@@server_uid``: a hash of a MAC
# address and the port, the same across restarts) and when that server started (from Uptime, to the second).
# Signed: UNSIGNED arithmetic fails (error 1690) where a difference goes below zero.
_BOOTED = """(CAST(UNIX_TIMESTAMP() AS SIGNED) - (
    SELECT CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'UPTIME'))"""
_SESSION_SQL: dict[str, str | None] = {
    # This connection's session. -> id, host, server, booted
    "SESSION_OF": f"""
        SELECT ID AS id, HOST AS host, @@server_uid AS server, {_BOOTED} AS booted
        FROM information_schema.PROCESSLIST WHERE ID = CONNECTION_ID()""",
    # Whether this connection reached that session's server, and whether the session is still there.
    # params: SESSION_OF's row -> same_server, alive
    "SESSION_FIND": f"""
        SELECT @@server_uid = :server AND ABS({_BOOTED} - :booted) <= 2 AS same_server,
               EXISTS (SELECT 1 FROM information_schema.PROCESSLIST WHERE ID = :id AND HOST = :host) AS alive""",
    # Sent only once SESSION_FIND has found the session on this server. params: id
    "SESSION_END": "KILL CONNECTION :id",
}


_SEM_TAKE = """UPDATE permits_semaphore
            SET used = used + :count, last_token = LAST_INSERT_ID(last_token + 1), updated_at_ms = {now}
            WHERE name = :name AND deleted = 0 AND used + :count <= capacity{fair_gate}"""


# ---- a grant of one semaphore (ACQUIRE_ONE), and the semaphore's line
#
# A grant's wait for a semaphore row's lock (another session holds it: a grant over several semaphores, a
# change of capacity, a forgotten transaction in a SQL console) lasts no longer than the caller's time
# (lock_wait_s, whole seconds, as innodb_lock_wait_timeout counts them; NULL: the session's lock wait, as for
# a try that does not wait). SET STATEMENT sets it for the one statement, so nothing is left changed in the
# session when a batch stops at an error.
_LOCK_WAIT_BOUND = "SET STATEMENT innodb_lock_wait_timeout = COALESCE(:lock_wait_s, @@innodb_lock_wait_timeout) FOR"
# The UPDATE that takes the room, and what follows it: the lease, its permit, the request's places in fair
# queues given up. The token goes through a session variable, which the request resets first: NULL means the
# UPDATE found no room, and then nothing is inserted.
_TAKE_ONE = f"""
            {_LOCK_WAIT_BOUND}
            UPDATE permits_semaphore
            SET used = used + :count, last_token = (@permits_token := last_token + 1), updated_at_ms = {{now}}
            WHERE name = :name AND deleted = 0 AND used + :count <= capacity{{fair_gate}}"""
_LEASE_ONE = """
            INSERT INTO permits_lease (
                owner, lease_key, state, acquired_at_ms, expires_at_ms, ttl_ms, request_id)
            SELECT :owner, :key, 1, {now}, {now} + :ttl_ms, :ttl_ms, :request_id
            FROM DUAL WHERE @permits_token IS NOT NULL
            RETURNING id, acquired_at_ms, expires_at_ms, @permits_token;
            INSERT INTO permits_permit (lease_id, semaphore_id, count, token)
            SELECT LAST_INSERT_ID(), """
_PLACES_GIVEN_UP = """
            DELETE FROM permits_waiter WHERE owner = :owner AND lease_key = :key AND @permits_token IS NOT NULL;"""
_GRANT_ONE = (
    _LEASE_ONE
    + """id, :count, @permits_token FROM permits_semaphore
            WHERE name = :name AND deleted = 0 AND @permits_token IS NOT NULL;"""
    + _PLACES_GIVEN_UP
    + """
            COMMIT"""
)
#: The semaphore's line: a row of permits_line (migration 0010), by the name's CRC32. Its rows are never
#: written; only their locks are used.
_LINE_ROW = "MOD(CRC32(:name), 1023)"
#: ACQUIRE_ONE_LINE_FREE's gate (see there)
_LINE_FREE = f"""
              AND EXISTS (SELECT 1 FROM permits_line WHERE id = {_LINE_ROW} LOCK IN SHARE MODE SKIP LOCKED)"""
# Wait for the line: a READ COMMITTED transaction that takes the line's row FOR UPDATE. InnoDB grants a row's
# lock to those waiting for it in the order they asked, so the waiters take their turns in order, and one
# that asks again goes behind those already waiting. The request holds nothing but that wait: a waiter
# killed while it waits is granted nothing (its session fails to answer, and rolls back). innodb_lock_wait_
# timeout counts whole seconds, so the wait is given in whole seconds; timed out, the request ends its
# transaction itself. First, before the wait (what follows the wait delays every waiter behind), it reads
# without a lock the semaphore's id, for the grant, and whether the count fits its capacity at all: if not,
# or if there is no such semaphore, it does not wait, and ends its transaction. READ COMMITTED: see
# LINE_HEAD; SET TRANSACTION lasts one transaction. It notes when the caller's time ends (@permits_ends, by
# SYSDATE, the time as each statement runs), for LINE_HEAD. params: name, wait_s, wait_ms, count -> one row:
# in the line (1;
# its transaction stays open for LINE_GRANT on the same connection) or not (0: timed out, or no wait could
# help; nothing is open), the semaphore's id (NULL: no such semaphore), whether the count fits, and whether
# the semaphore is fair (the flow then sends LINE_HEAD_FAIR)
_LINE_WAIT = f"""
            SET @permits_ends = SYSDATE(6) + INTERVAL :wait_ms * 1000 MICROSECOND;
            SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
            SELECT MAX(id), COALESCE(MAX(:count <= capacity), 0), COALESCE(MAX(fair), 0)
            INTO @permits_sem, @permits_fits, @permits_fair
            FROM permits_semaphore WHERE name = :name AND deleted = 0;
            BEGIN NOT ATOMIC
                DECLARE CONTINUE HANDLER FOR 1205 ROLLBACK;
                SET @permits_line = 0;
                IF @permits_fits THEN
                    SET STATEMENT innodb_lock_wait_timeout = :wait_s FOR
                        SELECT 1 INTO @permits_line FROM permits_line WHERE id = {_LINE_ROW} FOR UPDATE;
                ELSE
                    ROLLBACK;
                END IF;
            END;
            SELECT @permits_line, @permits_sem, @permits_fits, @permits_fair"""
# The UPDATE of the line's grants: by the semaphore's primary key, which LINE_WAIT read (see LINE_HEAD). An
# UPDATE that waited for a row's lock (a grant, a release, a change of capacity in flight), then found its
# WHERE false on the row as that writer left it, keeps the lock to the end of its transaction, even under
# READ COMMITTED (MariaDB 10.11; a row it reached without waiting it lets go of). The head's transaction
# lasts its whole wait, so the release it waited for then waited for it. On a fair semaphore with places
# in its fair queue ahead of the head, the queue's grants write the row between the head's tries, and the
# head's wait starts again as the queue moves: there holds of 20 ms took 60 ms (the release's wait), and
# the line fell from 42 turns a second to 13 after one slow holder. So there (LINE_HEAD_FAIR, while places
# are ahead) the UPDATE never waits for the row's lock: a lock wait of 0 s is MariaDB's NOWAIT, whose
# error (1205, at once) the head catches and takes as one more refusal. Elsewhere nothing but a release
# writes the row between the head's tries, mostly (a grant over several semaphores, a change of capacity,
# a service's hand-over can), and after a release the head finds room: there it waits for the lock, which
# it is handed the moment the release commits. NOWAIT there too cost 5-13% at 64 clients on the hot
# benchmark (docs/benchmarks.md); the rare wait that ends in a refusal (a grant outside the line: a try that
# does not wait, a count above one, a grant over several semaphores, a client older than the line; a change
# of capacity) keeps the row no longer than the head's wait, 50 ms. LINE_GRANT, the head's first try, waits
# too: its one UPDATE seldom meets a grant in flight, and wrapping it for the error cost as much. Where it
# does, on a fair semaphore with places ahead, the head keeps the row through LINE_HEAD_FAIR, whose wait
# starts again as places ahead lapse or are given up, within the caller's time: a risk left, not measured
# apart (the slow-hold benchmark, which would show it, recovered in every run). A server started with
# innodb_rollback_on_timeout
# (off by default) would roll the head's whole transaction back at a 1205: there the store uses no line
# (``without_line``).
_TAKE_IN_LINE = _TAKE_ONE.replace("WHERE name = :name AND", "WHERE id = :sem_id AND")
_TAKE_NOWAIT = _TAKE_IN_LINE.replace(_LOCK_WAIT_BOUND, "SET STATEMENT innodb_lock_wait_timeout = 0 FOR")
_GRANT_IN_LINE = (
    _LEASE_ONE + """:sem_id, :count, @permits_token FROM DUAL WHERE @permits_token IS NOT NULL;""" + _PLACES_GIVEN_UP
)
# At the head of the line (after LINE_WAIT, in its transaction): ask once, and commit if granted, which lets
# the line go; refused, the transaction stays open (the line held) for LINE_HEAD. Only a client that was alive
# at its turn sends this. params: ACQUIRE_ONE's, sem_id -> as ACQUIRE_ONE
_LINE_GRANT = (
    "SET @permits_token = NULL;"
    + _TAKE_IN_LINE
    + ";"
    + _GRANT_IN_LINE
    + """
            BEGIN NOT ATOMIC IF @permits_token IS NOT NULL THEN COMMIT; END IF; END"""
)
# Still at the head, refused: ask again every 1 ms and then every 2 ms (in LINE_HEAD_FAIR, 0.2 ms after a try
# that found the row busy, which counts as a tenth of a try: the writer in flight lets go of it within a
# fraction of a millisecond), up to ``tries`` times, in this one request, as PostgreSQL's queued
# grant waits at the head (pg_functions.py); then the lease, or nothing, and the COMMIT that lets the line
# go. A grant for a waiter that died meanwhile is possible only within this wait (``LINE_HEAD_WAIT_SECONDS``),
# as for any grant whose reply is lost. No UPDATE here may keep the semaphore row locked when it finds no
# room, or the release the head waits for would wait for the head: READ COMMITTED lets go of a row the
# UPDATE reached by its primary key, without waiting for its lock (where it may wait, see _TAKE_IN_LINE),
# and did not change (through the unique index on the name InnoDB kept the
# lock to the end of the transaction), and nothing reads the row in the loop's condition (MariaDB makes
# such a read, and a SET from a subquery, a locking one; a SELECT ... INTO is not).
#
# On a fair semaphore (LINE_WAIT's ``fair``: the flow sends LINE_HEAD_FAIR), live places in its fair queue
# ahead of the head keep the room
# for their waiters, who ask outside the line; each time fewer of the places that were ahead at the head's
# first refusal here remain (one was served, or given up), its ``tries`` start again, until the caller's
# time ends (@permits_ends, which LINE_WAIT noted before its wait; ``most_tries`` too, in case SYSDATE is
# NOW, fixed for the whole statement, under --sysdate-is-now), as PostgreSQL's head's wait starts again
# (pg_functions.py, where the same cascade is described). The head asks once at least, as there. Without
# that, one holder slower than the head's wait (LINE_HEAD_WAIT_SECONDS) made the head take a place behind
# the queue, and the next head behind it, for as long as waiters came: six processes on a fair mutex held
# 20 ms, 42 turns a second, took 12 to 17 a second after one hold of 0.3 s, for the ten seconds measured
# (tests/concurrency/test_mariadb_line.py). Unlike PostgreSQL's, ``{now}`` here may be read again at each
# count, so a place that lapses during the wait counts as served. params: LINE_GRANT's, tries, most_tries ->
# as ACQUIRE_ONE
_PLACES_AHEAD = """FROM permits_waiter w
                        WHERE w.semaphore_id = :sem_id AND w.expires_at_ms > {now}
                          AND w.ticket < COALESCE(
                              (SELECT m.ticket FROM permits_waiter m
                               WHERE m.semaphore_id = :sem_id AND m.owner = :owner AND m.lease_key = :key),
                              9223372036854775807)"""
_LINE_HEAD = (
    """
            SET @permits_token = NULL;
            BEGIN NOT ATOMIC
                DECLARE tries INT DEFAULT 0;
                head: LOOP"""
    + _TAKE_IN_LINE.replace("\n", "\n        ")
    + """;
                    SET tries = tries + 1;
                    IF @permits_token IS NOT NULL OR tries >= :tries OR SYSDATE(6) >= @permits_ends THEN
                        LEAVE head;
                    END IF;
                    DO SLEEP(IF(tries < 10, 0.001, 0.002));
                END LOOP;
            END;"""
    + _GRANT_IN_LINE
    + """
            COMMIT"""
)
# LINE_HEAD on a fair semaphore. Each try first reads the places ahead, and while there are some, its UPDATE
# does not wait for the row's lock (see _TAKE_IN_LINE); a busy try asks again 0.2 ms later and counts as a
# tenth of a try.
_LINE_HEAD_FAIR = (
    """
            SET @permits_token = NULL;
            BEGIN NOT ATOMIC
                DECLARE tries DECIMAL(10, 1) DEFAULT 0;
                DECLARE asked DECIMAL(10, 1) DEFAULT 0;
                DECLARE horizon BIGINT DEFAULT NULL;
                DECLARE ahead BIGINT DEFAULT NULL;
                DECLARE last_ahead BIGINT DEFAULT NULL;
                DECLARE waiting BIGINT DEFAULT 0;
                DECLARE newest BIGINT DEFAULT NULL;
                DECLARE busy INT DEFAULT 0;
                DECLARE CONTINUE HANDLER FOR 1205 SET busy = 1;
                head: LOOP
                    SET busy = 0;
                    SELECT COUNT(*), COUNT(CASE WHEN w.ticket <= horizon THEN 1 END), MAX(w.ticket)
                    INTO waiting, ahead, newest
                    """
    + _PLACES_AHEAD
    + """;
                    IF last_ahead IS NULL THEN SET ahead = waiting, horizon = newest; END IF;
                    IF ahead < last_ahead THEN SET tries = 0; END IF;
                    SET last_ahead = ahead;
                    IF waiting > 0 THEN"""
    + _TAKE_NOWAIT.replace("\n", "\n            ")
    + """;
                    ELSE"""
    + _TAKE_IN_LINE.replace("\n", "\n            ")
    + """;
                    END IF;
                    SET tries = tries + IF(busy, 0.1, 1), asked = asked + IF(busy, 0.1, 1);
                    IF @permits_token IS NOT NULL OR asked >= :most_tries OR SYSDATE(6) >= @permits_ends THEN
                        LEAVE head;
                    END IF;
                    IF tries >= :tries THEN LEAVE head; END IF;
                    DO SLEEP(IF(busy, 0.0002, IF(tries < 10, 0.001, 0.002)));
                END LOOP;
            END;"""
    + _GRANT_IN_LINE
    + """
            COMMIT"""
)


#: The statements of the line, for the dialects that have none.
_NO_LINE: dict[str, str | None] = dict.fromkeys(
    ("ACQUIRE_ONE_LINE_FREE", "LINE_WAIT", "LINE_GRANT", "LINE_HEAD", "LINE_HEAD_FAIR")
)


class MariaDB(Dialect):
    name = "mysql"
    # UNIX_TIMESTAMP of the statement's start time; sessions run in UTC (see engine_options) so no daylight
    # saving hour is ever ambiguous.
    now_sql = "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000 AS SIGNED)"
    sync_driver = "pymysql"
    async_driver = "aiomysql"
    extra = "mysql"
    # PyMySQL and aiomysql send COMMIT (and ROLLBACK) even when there is nothing to end, so a statement in
    # autocommit would still cost two round trips through SQLAlchemy: the hot statements carry their own
    # COMMIT and go as one request instead. A grant and a release are then one round trip each, like the
    # bare conditional UPDATE.
    self_committing = True
    overrides: ClassVar[dict[str, str | None]] = {
        **_SESSION_SQL,
        # No UPDATE ... RETURNING here: LAST_INSERT_ID(expr) stores the new token in the session and the
        # server sends it back in the OK packet (cursor.lastrowid), so it costs no extra round trip. Its wait
        # for the row's lock is bounded by the caller's time (_LOCK_WAIT_BOUND): a grant a statement at a
        # time (a Galera node; several semaphores on MariaDB 10.5) takes its rows here. params: name, count,
        # owner, key, lock_wait_s
        "SEM_TAKE": f"""
            {_LOCK_WAIT_BOUND}
            {_SEM_TAKE}""",
        # Acquire one semaphore in one request (see self_committing). The token goes through a session
        # variable, reset first: NULL means the UPDATE found no room, and then neither INSERT inserts anything
        # and the batch commits nothing. LAST_INSERT_ID() is the lease's new id. A grant also gives up the
        # request's places in fair queues (a waiting caller may hold some). params: owner, key, name,
        # count, ttl_ms, request_id, lock_wait_s -> lease id, acquired_at_ms, expires_at_ms, token (no row:
        # no room, or no such semaphore)
        "ACQUIRE_ONE": "SET @permits_token = NULL;" + _TAKE_ONE + ";" + _GRANT_ONE,
        # ACQUIRE_ONE for a caller that would otherwise wait in the semaphore's line (LINE_WAIT), granted only
        # while nobody holds the line or waits for it: a shared lock on the line's row, taken with SKIP
        # LOCKED, is skipped while anyone holds its exclusive lock or is queued for it. Shared locks do not
        # conflict with each other, so grants outside an empty line pass each other freely. MariaDB reads
        # the uncorrelated subquery first, as a constant: a grant it refuses locks no semaphore row. No row:
        # somebody was in the line, or there was no room; the caller then asks in the line.
        # params: ACQUIRE_ONE's -> as ACQUIRE_ONE
        "ACQUIRE_ONE_LINE_FREE": "SET @permits_token = NULL;" + _TAKE_ONE + _LINE_FREE + ";" + _GRANT_ONE,
        "LINE_WAIT": _LINE_WAIT,
        "LINE_GRANT": _LINE_GRANT,
        "LINE_HEAD": _LINE_HEAD,
        "LINE_HEAD_FAIR": _LINE_HEAD_FAIR,
        # Acquire several semaphores in one request (see self_committing), all or none, as PostgreSQL's
        # ACQUIRE_MANY does. The optimizer takes a user variable as a constant, so a statement whose WHERE
        # tests one that is not 1 reads no row and locks none ("Impossible WHERE"). First a plain read, which
        # locks nothing, of whether every semaphore exists and has room: a request that will be refused then
        # waits for no row and holds none. Then the rows are locked in name order (_WANTED_ROWS) and checked
        # again under the locks, the fair gate included; only if every one fits are they all written, with
        # the lease, its permits, and the request's places in fair queues given up. The fair gate's reads of
        # the queue lock too (LOCK IN SHARE MODE): a plain read inside a locking one reads the snapshot
        # the first read took, which misses a waiter that took its place while this batch waited for a row
        # (it did, and a request over a fair semaphore and another one was granted ahead of it: a test in
        # tests/concurrency/test_lock_order.py shows it). The last statement
        # answers, as PostgreSQL's does, a row per semaphore. Where the grant a statement per step held the
        # rows locked across a round trip per semaphore, the lease and the permits, this holds them for one.
        # The locking read waits for the rows no longer than the caller's time (_LOCK_WAIT_BOUND).
        # params: owner, key, wants (JSON), ttl_ms, request_id, lock_wait_s -> lease id, acquired_at_ms,
        # expires_at_ms, name, token: a row per semaphore (none: no room in one of them, or one does not exist)
        "ACQUIRE_MANY": """
            SET @permits_seen = NULL, @permits_fit = NULL;
            SELECT COUNT(*) = JSON_LENGTH(:wants) AND COALESCE(MIN(s.used + w.count <= s.capacity), 0)
            INTO @permits_seen
            FROM """
        + _WANTED_ROWS
        + """
            WHERE s.deleted = 0;
            """
        + _LOCK_WAIT_BOUND
        + """
            SELECT COUNT(*) = JSON_LENGTH(:wants) AND COALESCE(MIN(
                """
        + row_has_room("s", "w.count", locking=" LOCK IN SHARE MODE")
        + """), 0)
            INTO @permits_fit
            FROM """
        + _WANTED_ROWS
        + """
            WHERE s.deleted = 0 AND @permits_seen = 1
            FOR UPDATE;
            UPDATE """
        + _WANTED_ROWS
        + """
            SET s.used = s.used + w.count, s.last_token = s.last_token + 1, s.updated_at_ms = {now}
            WHERE s.deleted = 0 AND @permits_fit = 1;
            INSERT INTO permits_lease (
                owner, lease_key, state, acquired_at_ms, expires_at_ms, ttl_ms, request_id)
            SELECT :owner, :key, 1, {now}, {now} + :ttl_ms, :ttl_ms, :request_id FROM DUAL WHERE @permits_fit = 1;
            INSERT INTO permits_permit (lease_id, semaphore_id, count, token)
            SELECT LAST_INSERT_ID(), s.id, w.count, s.last_token
            FROM """
        + _WANTED_ROWS
        + """
            WHERE s.deleted = 0 AND @permits_fit = 1;
            DELETE FROM permits_waiter WHERE owner = :owner AND lease_key = :key AND @permits_fit = 1;
            SELECT l.id, l.acquired_at_ms, l.expires_at_ms, s.name, p.token
            FROM permits_lease l
            JOIN permits_permit p ON p.lease_id = l.id
            JOIN permits_semaphore s ON s.id = p.semaphore_id
            WHERE l.owner = :owner AND l.lease_key = :key AND @permits_fit = 1;
            COMMIT""",
        # A line's turn in one request (see self_committing), as PostgreSQL's HAND_OVER: the releases first (their
        # leases found by a plain read, which locks nothing: a locking read would lock the semaphore rows its check
        # reads, before the lease rows, against every release's order, and a key with no lease would take a gap lock
        # that a grant's insert waits on; then the lease rows locked by id and checked again, their ids kept, and
        # ended), then the semaphore's row, locked and read: the room, once the releases have given theirs back, bounds
        # the requests granted, in the order given; the row is written once, the releases always and the grants on the
        # condition that they fit the row as written, and the k-th request granted gets the k-th of the new tokens.
        # Every later step is gated on a session variable (a constant to the optimizer: a gated statement that says no
        # reads nothing). A fair semaphore, and a lease that holds permits of another semaphore too, take no part. The
        # last statement answers: kind 1, a request granted; 2, a lease released; 3, the semaphore's room and fair flag,
        # as PostgreSQL's. params: name, gone (JSON), asked (JSON) -> kind, owner, key, acquired_at_ms, expires_at_ms,
        # token
        "HAND_OVER": """
            SET @permits_gone = NULL, @permits_n = 0, @permits_sem = NULL, @permits_k = 0,
                @permits_before = NULL;
            SELECT JSON_ARRAYAGG(DISTINCT l.id) INTO @permits_gone
            FROM """
        + _GONE
        + """
            STRAIGHT_JOIN permits_lease l FORCE INDEX (uq_permits_lease_owner_key)
                ON l.owner = g.owner AND l.lease_key = g.lease_key
            WHERE l.state = 1
                AND NOT EXISTS (
                    SELECT 1 FROM permits_permit p JOIN permits_semaphore o ON o.id = p.semaphore_id
                    WHERE p.lease_id = l.id AND (o.name <> :name OR o.fair <> 0));
            SELECT JSON_ARRAYAGG(l.id) INTO @permits_gone
            FROM """
        + _ENDED
        + """ STRAIGHT_JOIN permits_lease l FORCE INDEX (PRIMARY) ON l.id = j.id
            WHERE l.state = 1 AND l.expires_at_ms > {now}
            FOR UPDATE;
            UPDATE """
        + _ENDED
        + """ STRAIGHT_JOIN permits_lease l FORCE INDEX (PRIMARY) ON l.id = j.id
            SET l.state = 0, l.end_reason = 'released', l.ended_at_ms = {now};
            SELECT COALESCE(SUM(p.count), 0) INTO @permits_n
            FROM """
        + _ENDED
        + """ STRAIGHT_JOIN permits_permit p FORCE INDEX (PRIMARY) ON p.lease_id = j.id;
            SELECT id, CASE WHEN fair = 0 AND deleted = 0
                THEN LEAST(GREATEST(capacity - used + @permits_n, 0), JSON_LENGTH(:asked)) ELSE 0 END
            INTO @permits_sem, @permits_k
            FROM permits_semaphore WHERE name = :name
            FOR UPDATE;
            UPDATE permits_semaphore
            SET used = used - @permits_n
                    + (@permits_k := CASE WHEN used - @permits_n + @permits_k <= capacity THEN @permits_k ELSE 0 END),
                last_token = (@permits_before := last_token) + @permits_k, updated_at_ms = {now}
            WHERE id = @permits_sem AND (@permits_n > 0 OR @permits_k > 0);
            INSERT INTO permits_lease (owner, lease_key, state, acquired_at_ms, expires_at_ms, ttl_ms)
            SELECT a.owner, a.lease_key, 1, {now}, {now} + a.ttl_ms, a.ttl_ms FROM """
        + _ASKED
        + """
            WHERE a.place <= @permits_k AND @permits_before IS NOT NULL
            ORDER BY a.place;
            INSERT INTO permits_permit (lease_id, semaphore_id, count, token)
            SELECT l.id, @permits_sem, 1, @permits_before + a.place FROM """
        + _ASKED
        + """
            STRAIGHT_JOIN permits_lease l FORCE INDEX (uq_permits_lease_owner_key)
                ON l.owner = a.owner AND l.lease_key = a.lease_key
            WHERE a.place <= @permits_k AND @permits_before IS NOT NULL;
            SELECT 1, l.owner, l.lease_key, l.acquired_at_ms, l.expires_at_ms, p.token FROM """
        + _ASKED
        + """
            STRAIGHT_JOIN permits_lease l FORCE INDEX (uq_permits_lease_owner_key)
                ON l.owner = a.owner AND l.lease_key = a.lease_key
            JOIN permits_permit p ON p.lease_id = l.id AND p.semaphore_id = @permits_sem
            WHERE a.place <= @permits_k AND @permits_before IS NOT NULL
            UNION ALL
            SELECT 2, l.owner, l.lease_key, NULL, NULL, NULL
            FROM """
        + _ENDED
        + """ STRAIGHT_JOIN permits_lease l FORCE INDEX (PRIMARY) ON l.id = j.id
            UNION ALL
            SELECT 3, NULL, NULL, s.capacity - s.used, NULL, s.fair
            FROM (SELECT 1) AS one LEFT JOIN permits_semaphore s ON s.name = :name AND s.deleted = 0;
            COMMIT""",
        "SEM_TICKET": """
            UPDATE permits_semaphore SET last_ticket = LAST_INSERT_ID(last_ticket + 1) WHERE id = :id""",
        # Release in one request (see self_committing).
        "RELEASE": _RELEASE_UPDATE + ";\n            COMMIT",
        "LEASE_END_ONE": None,
        "SEM_GIVE_BACK_LEASE": None,
    }

    def taken_token(self, result: Result) -> int:
        if result.lastrowid is None:  # pragma: no cover - the driver always reports it
            raise RuntimeError("the MySQL driver did not report LAST_INSERT_ID")
        return int(result.lastrowid)

    def taken_fair(self, result: Result) -> bool | None:
        return None  # SEM_TAKE answers with the token alone (there is no UPDATE ... RETURNING)

    def engine_options(self, lock_wait_timeout: float, pooler: str | None = None) -> dict[str, Any]:
        # Waiting long on a row lock only holds a connection: fail fast and let the retry loop back off. The
        # same for a table's metadata lock (lock_wait_timeout, a year by default): an upgrade's ALTER TABLE
        # that waits for it behind an open transaction queues every later statement on the table behind
        # itself, and would stall every client until that transaction ended.
        seconds = max(1, round(lock_wait_timeout))
        # A client frozen or cut off inside a transaction would keep its row locks until wait_timeout (8
        # hours by default): MariaDB ends such a transaction after IDLE_IN_TRANSACTION_SECONDS instead. The
        # /*M! */ comment runs on MariaDB >= 10.3 only; MySQL, which has no such setting, skips it.
        idle = IDLE_IN_TRANSACTION_SECONDS
        return {
            "connect_args": {
                "client_flag": _FOUND_ROWS | _MULTI_STATEMENTS,
                "init_command": f"SET SESSION innodb_lock_wait_timeout = {seconds}, lock_wait_timeout = {seconds},"
                " time_zone = '+00:00'"
                f" /*M!100300 , idle_transaction_timeout = {idle} */",
                "connect_timeout": 5,
            },
            "pool_recycle": 3600,
        }

    def check_driver(self, asynchronous: bool) -> None:
        require_module("aiomysql" if asynchronous else "pymysql", self.extra)

    def reply_timeout_args(self, reply_timeout: float, asynchronous: bool) -> dict[str, Any]:
        # The drivers' connect_timeout covers the TCP connect only: over a stalled link the handshake's read
        # would wait until TCP gave up. PyMySQL's read and write timeouts bound the handshake, and are lifted
        # once it is done (``connected``): they would also cut statements the store means to let run, such
        # as a migration, and the store bounds an operation's statements itself (``reply_socket``).
        # aiomysql has no such arguments, so its whole connect is bounded, through SQLAlchemy's hook for
        # making the connection.
        seconds = math.ceil(reply_timeout)
        if not asynchronous:
            return {"read_timeout": seconds, "write_timeout": seconds}
        return {"async_creator_fn": _aiomysql_connect_within(seconds)}

    def connect_within(self, cparams: dict[str, Any], seconds: float) -> dict[str, Any]:
        whole = max(1, math.ceil(seconds))  # the drivers take whole seconds
        lowered = dict(cparams)
        for name in ("connect_timeout", "read_timeout", "write_timeout"):
            if name in lowered:
                lowered[name] = min(int(lowered[name]), whole)
        if "async_creator_fn" in lowered:
            lowered["async_creator_fn"] = _aiomysql_connect_within(whole)
        return lowered

    def connected(self, dbapi_connection: Any) -> None:
        if hasattr(dbapi_connection, "_read_timeout"):  # PyMySQL's: each read and write applies them anew
            dbapi_connection._read_timeout = dbapi_connection._write_timeout = None

    def in_transaction(self, driver: Any) -> bool:
        # SERVER_STATUS_IN_TRANS, from the last reply's status flags (PyMySQL and aiomysql keep them alike).
        return bool(getattr(driver, "server_status", 0) & _SERVER_STATUS_IN_TRANS)

    def handshake_session(self, driver: Any) -> int | None:
        try:
            return int(driver.server_thread_id[0])  # PyMySQL's and aiomysql's alike
        except Exception:
            return None

    def tells_sessions_apart(self, driver: Any) -> bool:
        # MySQL has no @@server_uid (see _SESSION_SQL); the dialect for it is picked only once the client
        # opens, after its first connection.
        return "mariadb" in str(getattr(driver, "server_version", "")).lower()

    def reply_socket(self, driver: Any) -> int | None:
        # Neither driver gives its socket publicly.
        try:
            writer = getattr(driver, "_writer", None)  # aiomysql: an asyncio stream
            sock = writer.get_extra_info("socket") if writer is not None else driver._sock  # PyMySQL
            return int(sock.fileno())
        except Exception:  # closed, or another driver: no deadline rather than no statement
            return None

    def _classify(self, orig: BaseException | None) -> Fault:
        args = getattr(orig, "args", ())
        code = args[0] if args and isinstance(args[0], int) else None
        if code in _CONFLICT:
            return Fault.CONFLICT
        if code in _UNAVAILABLE:
            return Fault.UNAVAILABLE
        if code in _DUPLICATE:
            return Fault.DUPLICATE
        if code in _READ_ONLY:
            return Fault.READ_ONLY
        if code in _SCHEMA:
            return Fault.SCHEMA
        return Fault.OTHER


class MySQL(MariaDB):
    """Oracle MySQL 8: like MariaDB, but without INSERT ... RETURNING."""

    insert_returning = False
    overrides: ClassVar[dict[str, str | None]] = {
        **MariaDB.overrides,
        # MySQL has no INSERT ... RETURNING: one semaphore goes the way of several, and its waiters wait without
        # the line (which is written for MariaDB's compound statements).
        "ACQUIRE_ONE": None,
        # Nor SET STATEMENT: its grant waits for a row's lock the session's lock wait.
        "SEM_TAKE": f"""
            {_SEM_TAKE}""",
        **_NO_LINE,
        # Written for MariaDB's collation and plan hints, and not tried on MySQL: a statement per step.
        "ACQUIRE_MANY": None,
        "HAND_OVER": None,
        "LEASE_INSERT": """
            INSERT INTO permits_lease (
                owner, lease_key, state, acquired_at_ms, expires_at_ms, ttl_ms, request_id)
            VALUES (:owner, :key, 1, {now}, {now} + :ttl_ms, :ttl_ms, :request_id)""",
        # MySQL has no @@server_uid, and keeps its status in performance_schema: a cut session is not ended
        # there (not written for it until a MySQL server is in the tests).
        **dict.fromkeys(_SESSION_SQL),
    }


# ---- multi-primary clusters: Galera (MariaDB Galera Cluster, Percona XtraDB Cluster), Group Replication
#
# A node of such a cluster may roll back a local transaction at any moment, between two of its statements,
# because a transaction from another node that was ordered first needs its rows (a "brute force" abort). The
# abort is reported to the client as 1213 on its next request. Inside one request of several statements it
# is not reliably reported: the tests caught a Galera node running the rest of a grant's batch in a new
# transaction after the UPDATE of the semaphore row had been rolled back, which committed a permit row with
# no lease and no count behind it (the fencing token then ran ahead of the semaphore's last_token and every
# later grant met a duplicate token). Stored procedures are known to swallow the same error
# (codership/mysql-wsrep#191). On these clusters every statement therefore goes as a request of its own,
# inside a transaction the store begins and commits, so that each abort is seen before COMMIT.

#: Which multi-primary replication a MariaDB or MySQL server runs, if any, how it logs its writes and what a
#: lock wait timeout rolls back (see without_line). -> Variable_name, Value
MULTI_PRIMARY_PROBE = """
    SHOW GLOBAL VARIABLES
    WHERE Variable_name IN (
        'wsrep_on', 'group_replication_group_name', 'log_bin', 'binlog_format', 'innodb_rollback_on_timeout')"""


class MariaDBCluster(MariaDB):
    """A MariaDB node of a Galera cluster: no batches (see above)."""

    self_committing = False
    overrides: ClassVar[dict[str, str | None]] = {
        **MariaDB.overrides,
        "ACQUIRE_ONE": None,  # a grant goes the way of a grant over several semaphores, a statement at a time
        # No line: its statements are batches, and a cluster's row locks are each node's own.
        **_NO_LINE,
        "ACQUIRE_MANY": None,
        "HAND_OVER": None,
        "RELEASE": _RELEASE_UPDATE,
    }


class MySQLCluster(MySQL):
    """A MySQL node of a Group Replication cluster, or a Percona XtraDB Cluster node: no batches."""

    self_committing = False
    overrides: ClassVar[dict[str, str | None]] = {**MySQL.overrides, "RELEASE": _RELEASE_UPDATE, "HAND_OVER": None}


def logs_statements(variables: list[tuple[str, str]]) -> bool:
    """``variables``: the answer to MULTI_PRIMARY_PROBE. The server writes a binary log of statements, where
    InnoDB refuses a write under READ COMMITTED (error 1665), as MariaDB's line writes (MIXED switches such
    writes to rows, and ROW logs rows)."""
    found = {str(name).lower(): str(value).upper() for name, value in variables}
    return found.get("log_bin", "OFF") in ("ON", "1") and found.get("binlog_format", "") == "STATEMENT"


def rolls_back_on_timeout(variables: list[tuple[str, str]]) -> bool:
    """``variables``: the answer to MULTI_PRIMARY_PROBE. A lock wait timeout (1205) rolls back the whole
    transaction, not the statement (``innodb_rollback_on_timeout``, off by default). The head of a fair
    semaphore's line takes a row busy with another writer as a 1205 (NOWAIT, see _TAKE_IN_LINE), which
    would end its transaction, the line's lock with it, and go on at the session's isolation level."""
    found = {str(name).lower(): str(value).upper() for name, value in variables}
    return found.get("innodb_rollback_on_timeout", "OFF") in ("ON", "1")


def without_line(variables: list[tuple[str, str]]) -> bool:
    """``variables``: the answer to MULTI_PRIMARY_PROBE. The server's settings rule the line out."""
    return logs_statements(variables) or rolls_back_on_timeout(variables)


def is_multi_primary(variables: list[tuple[str, str]]) -> bool:
    """``variables``: the answer to MULTI_PRIMARY_PROBE. Galera with wsrep on, or any server that has the
    Group Replication plugin loaded (its single-primary mode is not told apart: the cost is a few round
    trips, the risk would be a lost abort)."""
    found = {str(name).lower(): str(value) for name, value in variables}
    return found.get("wsrep_on", "OFF").upper() == "ON" or "group_replication_group_name" in found


class MariaDB105(MariaDB):
    """MariaDB 10.5, which has no JSON_TABLE: a grant over several semaphores a statement at a time."""

    # No line either: SKIP LOCKED, which a grant outside the line needs, came in 10.6.
    overrides: ClassVar[dict[str, str | None]] = {
        **MariaDB.overrides,
        "ACQUIRE_MANY": None,
        "HAND_OVER": None,
        **_NO_LINE,
    }


class MariaDBWithoutLine(MariaDB):
    """A MariaDB server whose settings rule the line out (``without_line``), so its waiters wait without
    it: a binary log of statements (``binlog_format = STATEMENT``), where InnoDB refuses writes under READ
    COMMITTED, which the line's grants are; or ``innodb_rollback_on_timeout``, which would end the head's
    transaction at a try that found the row busy."""

    overrides: ClassVar[dict[str, str | None]] = {**MariaDB.overrides, **_NO_LINE}


#: The first MariaDB with JSON_TABLE (ACQUIRE_MANY).
JSON_TABLE_SINCE = (10, 6)


def mysql_family_dialect(
    is_mariadb: bool, multi_primary: bool, version: tuple[int, ...] | None = None, no_line: bool = False
) -> MariaDB:
    """The dialect for a server the ``mysql://`` URL turned out to reach (``version``: the server's, as
    SQLAlchemy read it; None where unknown, taken as recent; ``no_line``: see ``without_line``)."""
    if multi_primary:
        return MariaDBCluster() if is_mariadb else MySQLCluster()
    if not is_mariadb:
        return MySQL()
    if version is not None and tuple(version[:2]) < JSON_TABLE_SINCE:
        return MariaDB105()
    return MariaDBWithoutLine() if no_line else MariaDB()


def _aiomysql_connect_within(seconds: float) -> Any:
    """aiomysql's connect, bounded as a whole to ``seconds`` (``reply_timeout_args``)."""
    import aiomysql

    async def bounded_connect(*args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(aiomysql.connect(*args, **kwargs), seconds)
        except TimeoutError as exc:  # as the driver's own error, which SQLAlchemy wraps and the store retries
            raise aiomysql.OperationalError(2003, f"no connection within {seconds:g} s") from exc

    return bounded_connect
