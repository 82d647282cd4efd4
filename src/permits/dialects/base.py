"""The portable statements, and what every dialect must say about itself.

Statements are data: a name, the SQL, and a contract comment. ``{now}`` stands for the database's clock
in milliseconds since the epoch: every lease time is computed by the database, never by a client, so
clients whose clocks disagree still agree on when a lease expires. Each dialect overrides only the
statements it writes differently (the SQLAlchemy shape: portable base, dialect differences).

Tables (all prefixed ``permits_``):
- ``permits_semaphore``: one row per name. ``used`` counts the permits held and ``last_token`` is the last
  fencing token handed out; both change in the transaction that grants or returns permits. A deleted
  semaphore stays as a tombstone (``deleted = 1``) so its tokens never restart.
- ``permits_lease``: one row per grant, keyed by (owner, lease_key) for idempotency. ``state`` is 1 while
  held and 0 once ended, with ``end_reason``; it never goes back.
- ``permits_permit``: the grant's share of each semaphore: count and fencing token. The record of truth that
  the reconciliation check sums.
- ``permits_capacity_change``: the audit trail of capacity changes.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import TextClause, bindparam, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from permits._core.flows import Result
from permits._exceptions import ConfigurationError
from permits.dialects import server_clock
from permits.dialects.observe_sql import OBSERVE_SQL

#: Appended to the WHERE of every statement that takes room (``{fair_gate}``). A fair semaphore keeps room
#: for the requests waiting ahead: a request is granted only if, after it, there is still room for every
#: live waiter that holds an earlier ticket. No waiter is passed over by a later request that takes room
#: it needs, and waiters that all fit are granted together rather than one at a time. A request that is
#: not queued compares as if its ticket were the largest, so it never jumps the queue. For a semaphore that
#: is not fair, ``fair = 0`` decides; the subquery is an index probe on an empty range anyway.
FAIR_GATE = """
          AND (permits_semaphore.fair = 0 OR used + :count + (
              SELECT COALESCE(SUM(w.count), 0) FROM permits_waiter w
              WHERE w.semaphore_id = permits_semaphore.id AND w.expires_at_ms > {now}
                AND w.ticket < COALESCE(
                    (SELECT m.ticket FROM permits_waiter m
                     WHERE m.semaphore_id = permits_semaphore.id AND m.owner = :owner AND m.lease_key = :key),
                    9223372036854775807)) <= capacity)"""


def row_has_room(row: str, count: str, locking: str = "") -> str:
    """A condition on one semaphore row, known by the alias ``row`` (with its id, used, capacity and fair),
    for a grant of ``count`` permits over several semaphores at once: it has room, and on a fair semaphore
    the room is not kept for waiters ahead of the request (FAIR_GATE's rule). ``locking``: a clause that
    makes the reads of the queue locking reads, which read the newest rows rather than the transaction's
    snapshot (MariaDB, see its ACQUIRE_MANY)."""
    return f"""{row}.used + {count} <= {row}.capacity AND ({row}.fair = 0 OR {row}.used + {count} + (
                    SELECT COALESCE(SUM(q.count), 0) FROM permits_waiter q
                    WHERE q.semaphore_id = {row}.id AND q.expires_at_ms > {{now}}
                      AND q.ticket < COALESCE(
                          (SELECT m.ticket FROM permits_waiter m
                           WHERE m.semaphore_id = {row}.id AND m.owner = :owner AND m.lease_key = :key{locking}),
                          9223372036854775807){locking}) <= {row}.capacity)"""


@dataclass(frozen=True)
class SettingFix:
    """A session setting the server lacks, and the statement that would set it there for the role."""

    name: str
    value: str  #: as ``set_config`` takes it
    statement: str


class Fault(enum.Enum):
    """How a database error should be handled."""

    CONFLICT = "conflict"  # deadlock, serialization failure, lock wait timeout, busy: retry the transaction
    UNAVAILABLE = "unavailable"  # cannot connect or connection lost: retry on a fresh connection
    DUPLICATE = "duplicate"  # unique constraint: the flow decides
    READ_ONLY = "read_only"  # a replica refused a write: do not retry, point at the primary
    SCHEMA = "schema"  # a table is missing: the schema needs `permits db upgrade`
    OTHER = "other"

    @property
    def retryable(self) -> bool:
        return self in (Fault.CONFLICT, Fault.UNAVAILABLE)


#: A transaction that sends nothing for this long is ended by the server, releasing its locks. permits'
#: own transactions last milliseconds; this only catches a client frozen or cut off half-way through one.
IDLE_IN_TRANSACTION_SECONDS = 30

# Parameters that carry a list, expanded into IN (...) by SQLAlchemy.
_EXPANDING = ("names", "ids", "sem_ids")


def _expands(template: str, param: str) -> bool:
    """A list parameter written ``IN :names`` is expanded by SQLAlchemy into one parameter per item (so the
    statement cannot go to the driver directly); one written ``= ANY(:names)`` goes as it is, an array
    (PostgreSQL)."""
    return f"IN :{param}" in template


PORTABLE_SQL: dict[str, str] = {
    # -> now_ms
    "NOW_MS": "SELECT {now}",
    # The schema's revision: a ping that reads a permits table, so it also finds tables gone or outdated.
    "SCHEMA_REVISION": "SELECT version_num FROM permits_alembic_version",
    # Take room on one semaphore and bump its fencing token, only if the room is there (and, on a fair
    # semaphore, the request is at the head of the queue).
    # params: name, count, owner, key -> rowcount 1 and the new token, or rowcount 0
    "SEM_TAKE": """
        UPDATE permits_semaphore
        SET used = used + :count, last_token = last_token + 1, updated_at_ms = {now}
        WHERE name = :name AND deleted = 0 AND used + :count <= capacity{fair_gate}
        RETURNING last_token, fair""",
    # Lock the named semaphores in name order, so two multi-semaphore acquires never wait in a cycle.
    # params: names -> id, name, capacity, used, created_at_ms
    "SEMS_LOCK": """
        SELECT id, name, capacity, used, created_at_ms FROM permits_semaphore
        WHERE name IN :names AND deleted = 0 ORDER BY name{for_update}""",
    # Every row of one lease, one per semaphore. params: owner, key
    # -> id, state, end_reason, acquired_at_ms, expires_at_ms, ended_at_ms, now_ms, name, count, token,
    #    end_note, ttl_ms, request_id
    "LEASE_FIND": """
        SELECT l.id, l.state, l.end_reason, l.acquired_at_ms, l.expires_at_ms, l.ended_at_ms, {now},
               s.name, p.count, p.token, l.end_note, l.ttl_ms, l.request_id
        FROM permits_lease l
        JOIN permits_permit p ON p.lease_id = l.id
        JOIN permits_semaphore s ON s.id = p.semaphore_id
        WHERE l.owner = :owner AND l.lease_key = :key
        ORDER BY s.name""",
    # params: owner, key, ttl_ms, request_id -> id, acquired_at_ms, expires_at_ms (unique (owner, lease_key))
    "LEASE_INSERT": """
        INSERT INTO permits_lease (
            owner, lease_key, state, acquired_at_ms, expires_at_ms, ttl_ms, request_id)
        VALUES (:owner, :key, 1, {now}, {now} + :ttl_ms, :ttl_ms, :request_id)
        RETURNING id, acquired_at_ms, expires_at_ms""",
    # params: id -> acquired_at_ms, expires_at_ms (for engines without INSERT ... RETURNING)
    "LEASE_TIMES": "SELECT acquired_at_ms, expires_at_ms FROM permits_lease WHERE id = :id",
    # One row per want, run once per want. params: lease_id, name, count, token
    "PERMIT_INSERT": """
        INSERT INTO permits_permit (lease_id, semaphore_id, count, token)
        SELECT :lease_id, id, :count, :token FROM permits_semaphore WHERE name = :name AND deleted = 0""",
    # Why an acquire was refused, in one read (one snapshot): whether its key has a lease already (a retry
    # of a request that was granted), and the semaphores' rows, read without locks (the refused are the
    # many on a hot semaphore, and must not hold the row the next grant needs), each with whether expired
    # leases hold it (to reclaim: only where it would make room). params: owner, key, names -> leased,
    # expired, id, name, capacity, used, fair: one row per semaphore found, or one row of NULL semaphore
    # columns (and expired 0) if none is.
    "REFUSAL_READ": """
        SELECT x.leased,
            CASE WHEN EXISTS (
                SELECT 1 FROM permits_lease l{held_index}
                {held_join} permits_permit p ON p.lease_id = l.id
                WHERE l.state = 1 AND l.expires_at_ms <= {now} AND p.semaphore_id = s.id)
            THEN 1 ELSE 0 END AS expired,
            s.id, s.name, s.capacity, s.used, s.fair
        FROM (SELECT
                CASE WHEN EXISTS (
                    SELECT 1 FROM permits_lease WHERE owner = :owner AND lease_key = :key) THEN 1 ELSE 0 END
                AS leased) x
        LEFT JOIN permits_semaphore s ON s.name IN :names AND s.deleted = 0
        ORDER BY s.name""",
    # ---- fair queues
    # Take the next ticket of a fair semaphore (this locks its row: tickets are handed out in the same
    # order on every semaphore of a request, since requests lock rows in name order). params: id -> ticket
    "SEM_TICKET": """
        UPDATE permits_semaphore SET last_ticket = last_ticket + 1 WHERE id = :id
        RETURNING last_ticket""",
    # params: sem_id, ticket, owner, key, count, place_ms, wake (the waiter's wake channel, or NULL)
    "WAITER_INSERT": """
        INSERT INTO permits_waiter
            (semaphore_id, ticket, owner, lease_key, count, enqueued_at_ms, expires_at_ms, wake_channel)
        VALUES (:sem_id, :ticket, :owner, :key, :count, {now}, {now} + :place_ms, :wake)""",
    # How many permits a queued request is short of fitting, per fair semaphore it waits on: in use, plus
    # wanted by the live waiters ahead and by itself, minus the capacity (see flows.Queued). Exactly when
    # it is above 0, the fair gate refuses the request. params: owner, key -> short (one row per live
    # place; none: the request holds no live place)
    "WAITER_SHORT": """
        SELECT s.used + m.count - s.capacity + COALESCE((
            SELECT SUM(w.count) FROM permits_waiter w
            WHERE w.semaphore_id = m.semaphore_id AND w.ticket < m.ticket AND w.expires_at_ms > {now}), 0)
        FROM permits_waiter m JOIN permits_semaphore s ON s.id = m.semaphore_id
        WHERE m.owner = :owner AND m.lease_key = :key AND m.expires_at_ms > {now}
            AND s.fair = 1 AND s.deleted = 0""",
    # What a request with no place in the fair queue could take now, and how many live places there are
    # (flows.OpenRoom): the fair gate's sum over every live place, since such a request comes after them
    # all. params: name -> free, places, fair
    "SEM_OPEN_ROOM": """
        SELECT s.capacity - s.used - CASE WHEN s.fair = 1 THEN COALESCE((
                SELECT SUM(w.count) FROM permits_waiter w
                WHERE w.semaphore_id = s.id AND w.expires_at_ms > {now}), 0) ELSE 0 END,
            CASE WHEN s.fair = 1 THEN (
                SELECT COUNT(*) FROM permits_waiter w
                WHERE w.semaphore_id = s.id AND w.expires_at_ms > {now}) ELSE 0 END,
            s.fair
        FROM permits_semaphore s WHERE s.name = :name AND s.deleted = 0""",
    # A waiter keeps its place by asking again (and says where to call it now). params: owner, key,
    # place_ms, wake -> rowcount
    "WAITERS_REFRESH": """
        UPDATE permits_waiter SET expires_at_ms = {now} + :place_ms, wake_channel = :wake
        WHERE owner = :owner AND lease_key = :key""",
    # params: owner, key
    "WAITERS_DELETE": "DELETE FROM permits_waiter WHERE owner = :owner AND lease_key = :key",
    # Live waiters of one semaphore, in queue order. params: name
    # -> owner, lease_key, count, ticket, enqueued_at_ms, expires_at_ms, now_ms
    "WAITERS_LIST": """
        SELECT w.owner, w.lease_key, w.count, w.ticket, w.enqueued_at_ms, w.expires_at_ms, {now}
        FROM permits_waiter w JOIN permits_semaphore s ON s.id = w.semaphore_id
        WHERE s.name = :name AND s.deleted = 0 AND w.expires_at_ms > {now}
        ORDER BY w.ticket""",
    # Places that expired (their waiter gave up or died). params: age_ms
    "WAITERS_PURGE": "DELETE FROM permits_waiter WHERE expires_at_ms <= {now} - :age_ms",
    # Held leases past their expiry that hold any of these semaphores. params: sem_ids -> id
    "EXPIRED_FOR_SEMS": """
        SELECT DISTINCT l.id FROM permits_lease l{held_index}
        {held_join} permits_permit p ON p.lease_id = l.id
        WHERE l.state = 1 AND l.expires_at_ms <= {now} AND p.semaphore_id IN :sem_ids""",
    # Lock leases and keep those still held: the re-check under lock means no lease is ended twice.
    # params: ids -> id
    "LEASES_LOCK_HELD": "SELECT id FROM permits_lease WHERE id IN :ids AND state = 1 ORDER BY id{for_update}",
    # The same for leases to end because they expired: each is re-checked as expired under its lock. The
    # expired read came before the lock, and an extend that had started before the expiry may have
    # committed in between (the row lock re-reads the newest version: InnoDB's locking reads do, and so
    # does PostgreSQL's re-check of a row that changed while it waited). params: ids -> id
    "LEASES_LOCK_EXPIRED": """
        SELECT id FROM permits_lease WHERE id IN :ids AND state = 1 AND expires_at_ms <= {now}
        ORDER BY id{for_update}""",
    # In name order: the semaphores' rows are then given back (locked) in the order every grant locks them.
    # params: ids -> semaphore_id, sum(count)
    "PERMITS_SUM": """
        SELECT p.semaphore_id, SUM(p.count)
        FROM permits_permit p JOIN permits_semaphore s ON s.id = p.semaphore_id
        WHERE p.lease_id IN :ids
        GROUP BY p.semaphore_id, s.name ORDER BY s.name""",
    # params: ids, reason, note
    "LEASES_END": """
        UPDATE permits_lease SET state = 0, end_reason = :reason, end_note = :note, ended_at_ms = {now}
        WHERE id IN :ids AND state = 1""",
    # Run once per semaphore. params: id, count
    "SEM_GIVE_BACK": "UPDATE permits_semaphore SET used = used - :count, updated_at_ms = {now} WHERE id = :id",
    # Release, step 1 (engines without a one-statement RELEASE). params: owner, key -> id of the ended lease
    "LEASE_END_ONE": """
        UPDATE permits_lease SET state = 0, end_reason = 'released', ended_at_ms = {now}
        WHERE owner = :owner AND lease_key = :key AND state = 1 AND expires_at_ms > {now}
        RETURNING id""",
    # Release, step 2: return the lease's permits to each of its semaphores. params: lease_id
    "SEM_GIVE_BACK_LEASE": """
        UPDATE permits_semaphore
        SET used = used - (SELECT p.count FROM permits_permit p
                           WHERE p.lease_id = :lease_id AND p.semaphore_id = permits_semaphore.id),
            updated_at_ms = {now}
        WHERE id IN (SELECT semaphore_id FROM permits_permit WHERE lease_id = :lease_id)""",
    # The TTL is the one asked for, else the lease's own (the grant's), else, for a lease granted before
    # leases kept theirs (migration 0008), the caller's default. The lease's own stays as it was granted: a
    # watchdog's extends, or one long extend, do not change what the next extend without a TTL gives.
    # A service's max_ttl bounds every expiry it sets, a lease's own TTL included (one granted by a library
    # client may be longer).
    # params: owner, key, ttl_ms (or NULL), default_ttl_ms, max_ttl_ms (or NULL: no bound)
    # -> rowcount 1 if the lease was held and unexpired
    "LEASE_EXTEND": """
        UPDATE permits_lease SET expires_at_ms = {now} + CASE
            WHEN :max_ttl_ms < COALESCE(:ttl_ms, ttl_ms, :default_ttl_ms) THEN :max_ttl_ms
            ELSE COALESCE(:ttl_ms, ttl_ms, :default_ttl_ms) END
        WHERE owner = :owner AND lease_key = :key AND state = 1 AND expires_at_ms > {now}""",
    # params: name -> owner, lease_key, count, token, acquired_at_ms, expires_at_ms, now_ms
    "HOLDERS": """
        SELECT l.owner, l.lease_key, p.count, p.token, l.acquired_at_ms, l.expires_at_ms, {now}
        FROM permits_lease l{held_index}
        {held_join} permits_permit p ON p.lease_id = l.id
        JOIN permits_semaphore s ON s.id = p.semaphore_id
        WHERE l.state = 1 AND s.name = :name AND s.deleted = 0
        ORDER BY p.token""",
    # Bring a deleted semaphore back; its fencing tokens carry on. params: name, capacity
    "SEM_REVIVE": """
        UPDATE permits_semaphore
        SET deleted = 0, capacity = :capacity, fair = :fair, used = 0, created_at_ms = {now}, updated_at_ms = {now}
        WHERE name = :name AND deleted = 1""",
    # params: name, capacity, fair (unique name)
    "SEM_INSERT": """
        INSERT INTO permits_semaphore (name, capacity, fair, used, last_token, deleted, created_at_ms, updated_at_ms)
        VALUES (:name, :capacity, :fair, 0, 0, 0, {now}, {now})""",
    # params: name -> name, capacity, used, last_token, created_at_ms, updated_at_ms, fair
    "SEM_GET": """
        SELECT name, capacity, used, last_token, created_at_ms, updated_at_ms, fair
        FROM permits_semaphore WHERE name = :name AND deleted = 0""",
    "SEM_LIST": """
        SELECT name, capacity, used, last_token, created_at_ms, updated_at_ms, fair
        FROM permits_semaphore WHERE deleted = 0 ORDER BY name""",
    # params: id, capacity
    "SEM_SET_CAPACITY": "UPDATE permits_semaphore SET capacity = :capacity, updated_at_ms = {now} WHERE id = :id",
    # params: name, old, new, by, reason
    "HISTORY_INSERT": """
        INSERT INTO permits_capacity_change (name, old_capacity, new_capacity, changed_by, reason, changed_at_ms)
        VALUES (:name, :old, :new, :by, :reason, {now})""",
    # params: name, limit -> name, old_capacity, new_capacity, changed_by, reason, changed_at_ms (newest first)
    "HISTORY_LIST": """
        SELECT name, old_capacity, new_capacity, changed_by, reason, changed_at_ms
        FROM permits_capacity_change WHERE name = :name
        ORDER BY changed_at_ms DESC, id DESC LIMIT :limit""",
    # Held leases (expired or not) with permits of one semaphore. params: sem_id -> id, expires_at_ms, now_ms
    "LEASES_HOLDING": """
        SELECT l.id, l.expires_at_ms, {now} FROM permits_lease l{held_index}
        {held_join} permits_permit p ON p.lease_id = l.id
        WHERE l.state = 1 AND p.semaphore_id = :sem_id""",
    # How many of these leases stand revoked (a forced delete counts those it ended, whether or not the
    # reply to the COMMIT arrived). params: ids -> count
    "LEASES_COUNT_REVOKED": """
        SELECT COUNT(*) FROM permits_lease WHERE id IN :ids AND state = 0 AND end_reason = 'revoked'""",
    # params: id
    "SEM_TOMBSTONE": "UPDATE permits_semaphore SET deleted = 1, used = 0, updated_at_ms = {now} WHERE id = :id",
    # A deleted semaphore's queue goes with it: a name created again (which revives the row and its id)
    # starts with an empty queue, fair or not. params: id
    "SEM_WAITERS_DELETE": "DELETE FROM permits_waiter WHERE semaphore_id = :id",
    # A revived semaphore starts with an empty queue: a waiter's enqueue that raced the delete (it read the
    # semaphore's id before) may have left a place on the tombstone. params: name
    "SEM_REVIVED_WAITERS_DELETE": """
        DELETE FROM permits_waiter
        WHERE semaphore_id IN (SELECT id FROM permits_semaphore WHERE name = :name)""",
    # Oldest expired leases first. params: limit -> id, owner, lease_key
    "EXPIRED_BATCH": """
        SELECT id, owner, lease_key FROM permits_lease{held_index}
        WHERE state = 1 AND expires_at_ms <= {now}
        ORDER BY expires_at_ms LIMIT :limit""",
    # Each semaphore's stored count beside the sum over its held permit rows, in one statement so both come
    # from one snapshot; its token counter beside its highest token; its permit rows without a lease; its
    # fair queue's ticket counter beside the highest ticket of a place. -> id, name, used, actual,
    # last_token, highest_token, orphaned, last_ticket, highest_ticket
    "DRIFT_CHECK": """
        SELECT s.id, s.name, s.used, COALESCE(h.used, 0),
               s.last_token,
               COALESCE((SELECT MAX(p.token) FROM permits_permit p WHERE p.semaphore_id = s.id), 0),
               (SELECT COUNT(*) FROM permits_permit p WHERE p.semaphore_id = s.id
                AND NOT EXISTS (SELECT 1 FROM permits_lease l WHERE l.id = p.lease_id)),
               {ticket_counter},
               COALESCE((SELECT MAX(w.ticket) FROM permits_waiter w WHERE w.semaphore_id = s.id), 0)
        FROM permits_semaphore s
        LEFT JOIN (SELECT p.semaphore_id, SUM(p.count) AS used FROM permits_lease l{held_index}
                   {held_join} permits_permit p ON p.lease_id = l.id
                   WHERE l.state = 1 GROUP BY p.semaphore_id) h ON h.semaphore_id = s.id
        WHERE s.deleted = 0 ORDER BY s.name""",
    # Permit rows whose lease is gone: no flow writes one (a permit and its lease commit together, and
    # go together), but a half-committed grant did (docs/deployment.md, Galera). params: sem_id
    "PERMITS_ORPHANED_DELETE": """
        DELETE FROM permits_permit WHERE semaphore_id = :sem_id
        AND NOT EXISTS (SELECT 1 FROM permits_lease l WHERE l.id = permits_permit.lease_id)""",
    # params: sem_id -> the highest fencing token of the semaphore's permit rows (held or not)
    "TOKEN_HIGHEST_ONE": """
        SELECT COALESCE(MAX(token), 0) FROM permits_permit WHERE semaphore_id = :sem_id""",
    # params: sem_id -> the highest ticket of the semaphore's places in its fair queue (live or not: an
    # expired place keeps its ticket, and its key, until purged)
    "TICKET_HIGHEST_ONE": """
        SELECT COALESCE(MAX(ticket), 0) FROM permits_waiter WHERE semaphore_id = :sem_id""",
    # params: id -> the last ticket handed out for the semaphore's fair queue
    "TICKET_COUNTER_ONE": "SELECT {ticket_counter} FROM permits_semaphore s WHERE s.id = :id",
    # params: sem_id -> sum(count) over held leases
    "USED_ACTUAL_ONE": """
        SELECT COALESCE(SUM(p.count), 0) FROM permits_lease l{held_index}
        {held_join} permits_permit p ON p.lease_id = l.id
        WHERE l.state = 1 AND p.semaphore_id = :sem_id""",
    # Held leases of one owner or owner range (byte order: every backend compares names exactly).
    # params: exact, low, high -> count
    "LEASES_HELD_BY": """
        SELECT COUNT(*) FROM permits_lease{held_index}
        WHERE state = 1 AND (owner = :exact OR (owner >= :low AND owner < :high))""",
    # Held leases per semaphore (held leases are few). -> name, leases
    "LEASES_PER_SEMAPHORE": """
        SELECT s.name, COUNT(*) FROM permits_lease l{held_index}
        {held_join} permits_permit p ON p.lease_id = l.id
        JOIN permits_semaphore s ON s.id = p.semaphore_id
        WHERE l.state = 1 AND s.deleted = 0
        GROUP BY s.name""",
    # -> owner (of held leases)
    "HELD_OWNERS": "SELECT DISTINCT owner FROM permits_lease{held_index} WHERE state = 1",
    # params: owner, limit -> id, lease_key
    "HELD_BY_OWNER": """
        SELECT id, lease_key FROM permits_lease{held_index}
        WHERE owner = :owner AND state = 1 ORDER BY id LIMIT :limit""",
    # Held leases acquired before now - age, oldest first. params: age_ms, limit -> id, owner, lease_key
    "HELD_OLDER_THAN": """
        SELECT id, owner, lease_key FROM permits_lease{held_index}
        WHERE state = 1 AND acquired_at_ms <= {now} - :age_ms
        ORDER BY acquired_at_ms LIMIT :limit""",
    # Ended leases, by ix_permits_lease_ended. params: age_ms, limit -> id
    "ENDED_OLDER_THAN": """
        SELECT id FROM permits_lease
        WHERE ended_at_ms <= {now} - :age_ms AND state = 0
        ORDER BY ended_at_ms LIMIT :limit""",
    # params: ids
    "PERMITS_DELETE": "DELETE FROM permits_permit WHERE lease_id IN :ids",
    # params: ids (the state check keeps a held lease from ever being deleted)
    "LEASES_DELETE_ENDED": "DELETE FROM permits_lease WHERE id IN :ids AND state = 0",
    # params: age_ms, limit -> id
    "HISTORY_OLDER_THAN": """
        SELECT id FROM permits_capacity_change WHERE changed_at_ms <= {now} - :age_ms
        ORDER BY changed_at_ms LIMIT :limit""",
    # params: ids
    "HISTORY_DELETE": "DELETE FROM permits_capacity_change WHERE id IN :ids",
    # params: id, used
    "SEM_SET_USED": "UPDATE permits_semaphore SET used = :used, updated_at_ms = {now} WHERE id = :id",
    # Only ever raises the counter: a fencing token is never handed out twice. params: id, token
    "SEM_RAISE_TOKEN": """
        UPDATE permits_semaphore SET last_token = :token, updated_at_ms = {now}
        WHERE id = :id AND last_token < :token""",
    # params: id, ticket (never lowers the counter)
    "SEM_RAISE_TICKET": """
        UPDATE permits_semaphore SET last_ticket = :ticket WHERE id = :id AND last_ticket < :ticket""",
}


class Dialect:
    """What permits needs to know about one kind of database."""

    name: ClassVar[str] = "base"
    #: SQL for the database's clock in milliseconds since the epoch
    now_sql: ClassVar[str] = ""
    #: ``{clock_now}``: the clock as it reads when the expression is evaluated (later than ``{now}`` in a
    #: statement that waited for a row lock), where the dialect has one; else ``now_sql``
    clock_now_sql: ClassVar[str] = ""
    #: appended to locking reads; empty where the engine has no row locks
    for_update: ClassVar[str] = " FOR UPDATE"
    #: ``{held_index}``, after ``permits_lease`` in the statements that read held leases, and ``{held_join}``,
    #: the join from those leases to their permits: SQLite's hints to read the held leases through their own
    #: index (migration 0007), then their permits by lease. Without them SQLite's planner, which has no
    #: statistics unless someone runs ANALYZE, read a semaphore's whole history for its holders, or (after
    #: ANALYZE) the whole lease table for a reclaim. The servers' planners know from their statistics how
    #: few leases are held (tests/conformance/test_history_reads.py).
    held_index: ClassVar[str] = ""
    held_join: ClassVar[str] = "JOIN"
    #: ``{ticket_counter}``: the last ticket handed out to semaphore ``s``'s fair queue (``SEM_TICKET``)
    ticket_counter: ClassVar[str] = "s.last_ticket"
    #: INSERT ... RETURNING is available
    insert_returning: ClassVar[bool] = True
    #: switching a pooled connection to autocommit and back costs no round trip (see Stmt.alone)
    free_autocommit: ClassVar[bool] = False
    #: a read-only transaction is cheaper than one that may write (SQLite: it takes no write lock), so a flow
    #: that found it must write restarts in a writing one rather than writing where it is, and a queued
    #: waiter that polls reads its place before it asks (``try_acquire``)
    cheaper_readonly: ClassVar[bool] = False
    #: a statement that runs alone (Stmt.alone) is a batch of statements ending in its own COMMIT. The store
    #: sends it as one request on the driver's connection, outside SQLAlchemy's transaction, whose COMMIT
    #: would cost a round trip of its own. A batch answers with its first result set that has columns, or
    #: else with its first statement's row count.
    self_committing: ClassVar[bool] = False
    #: the statements of a transaction go to the driver's own connection too (through ``cursor()``, as
    #: sqlite3 and psycopg offer it), inside the transaction SQLAlchemy began; only statements with a list
    #: parameter (``IN :names``) go through SQLAlchemy, which expands them
    statements_on_driver: ClassVar[bool] = False
    #: statements this dialect writes differently, or only it has (e.g. a one-statement RELEASE)
    overrides: ClassVar[Mapping[str, str | None]] = {}
    sync_driver: ClassVar[str] = ""
    async_driver: ClassVar[str] = ""
    #: the optional dependency that installs the drivers
    extra: ClassVar[str] = ""

    def __init__(self) -> None:
        sql = {**PORTABLE_SQL, **OBSERVE_SQL, **self.overrides}
        self._sql = {name: s for name, s in sql.items() if s is not None}
        self._clauses: dict[str, TextClause] = {}
        self._expanding = {
            name for name, template in self._sql.items() if any(_expands(template, p) for p in _EXPANDING)
        }
        now, clock_now = self._clock_sql()
        #: ``{now}`` as this dialect renders it, for SQL built around its statements (pg_functions.py)
        self.now = now
        gate = FAIR_GATE.format(now=now)
        for name, template in self._sql.items():
            filled = template.format(
                now=now,
                clock_now=clock_now,
                for_update=self.for_update,
                fair_gate=gate,
                held_index=self.held_index,
                held_join=self.held_join,
                ticket_counter=self.ticket_counter,
            )
            clause = text(filled.strip())
            expanding: list[Any] = [bindparam(p, expanding=True) for p in _EXPANDING if _expands(template, p)]
            self._clauses[name] = clause.bindparams(*expanding) if expanding else clause

    def _clock_sql(self) -> tuple[str, str]:
        """``{now}`` and ``{clock_now}``: the dialect's own, unless a test moved a server's clock (see
        ``server_clock``; nothing else installs one)."""
        now, clock_now = self.now_sql, self.clock_now_sql or self.now_sql
        offset = server_clock.offset_sql()
        if offset is None or self.name == "sqlite":
            return now, clock_now
        return server_clock.clock_sql(now), server_clock.clock_sql(clock_now)

    def with_statements(self, replacements: Mapping[str, str]) -> Dialect:
        """This dialect, sending ``replacements`` (SQL by statement name) instead of those statements: on
        PostgreSQL behind a transaction pooler, calls of the functions made from them (pg_functions.py)."""
        replaced = copy.copy(self)
        replaced._clauses = {**self._clauses, **{name: text(sql) for name, sql in replacements.items()}}
        return replaced

    def expands(self, name: str) -> bool:
        """The statement takes a list parameter (``IN :names``), which SQLAlchemy expands."""
        return name in self._expanding

    def has(self, name: str) -> bool:
        return name in self._clauses

    def clause(self, name: str) -> TextClause:
        return self._clauses[name]

    def sql(self, name: str) -> str:
        """The SQL text of a statement, as sent (for docs and tests)."""
        return str(self._clauses[name])

    def in_transaction(self, driver: Any) -> bool:
        """Whether the statement just sent alone on ``driver`` left a transaction open (only MariaDB's line
        does, on purpose: see ``Stmt.alone``)."""
        return False

    def taken_token(self, result: Result) -> int:
        """The counter that ``SEM_TAKE`` (fencing token) or ``SEM_TICKET`` (queue ticket) just bumped."""
        return int(result.rows[0][0])

    def taken_fair(self, result: Result) -> bool | None:
        """Whether the semaphore that ``SEM_TAKE`` just took room from is fair; ``None`` where the statement
        cannot say."""
        return bool(result.rows[0][1])

    # ---- engine set-up

    def engine_url(self, url: URL, asynchronous: bool) -> URL:
        """The URL with the driver permits uses for this backend. A URL may name either of our drivers
        (``mysql+pymysql://``); the sync or async twin is picked to match the client."""
        named = url.get_driver_name()
        if "+" in url.drivername and named not in (self.sync_driver, self.async_driver):
            raise ConfigurationError(
                f"permits drives {url.get_backend_name()} with {self.sync_driver}/{self.async_driver}, "
                f"not {named}: drop '+{named}' from the URL",
                driver=named,
            )
        driver = self.async_driver if asynchronous else self.sync_driver
        # mariadb:// is MySQL's dialect in SQLAlchemy, under the name "mariadb": permits' schema and statements
        # tell engines apart by that name (the byte-exact collation of names, the upgrade's lock), so a
        # mariadb:// URL is driven as mysql://, which SQLAlchemy then finds to be MariaDB all the same.
        backend = "mysql" if url.get_backend_name() == "mariadb" else url.get_backend_name()
        return url.set(drivername=f"{backend}+{driver}")

    def engine_options(self, lock_wait_timeout: float, pooler: str | None = None) -> dict[str, Any]:
        """SQLAlchemy ``create_engine`` options; ``pooler``: see ``Settings.pooler`` (PostgreSQL only)."""
        return {}

    def pooled_settings_fixes(self, row: tuple[Any, ...], lock_wait_timeout: float) -> list[SettingFix]:
        """Given the row of ``SESSION_TIMEOUTS``, the session settings that a transaction pooler keeps permits
        from making itself and that the server lacks, each with the statement that would set it there (none:
        all are there). The store tries each value (``SETTING_TRY``) before it advises the statement."""
        return []

    def on_connect_sql(self, lock_wait_timeout: float, pooler: str | None = None) -> str | None:
        """A statement to run on each new connection, for session settings that cannot go with the
        connection request itself (None: nothing to run)."""
        return None

    def check_driver(self, asynchronous: bool) -> None:
        """Raise ConfigurationError naming the extra to install when the driver is missing."""

    def reply_timeout_args(self, reply_timeout: float, asynchronous: bool) -> dict[str, Any]:
        """Connection arguments that bound each wait for the server, where the driver has them: they also
        cover the connection's own handshake, which no statement deadline does."""
        return {}

    def connect_within(self, cparams: dict[str, Any], seconds: float) -> dict[str, Any]:
        """The connection arguments with their bounds on the connect itself lowered to ``seconds`` (a caller's
        deadline is near, ``permits._deadline``), where the driver has such bounds."""
        return cparams

    def connected(self, dbapi_connection: Any) -> None:
        """Called on each new driver connection, once it is established (``reply_timeout_args``)."""

    def handshake_session(self, driver: Any) -> int | None:
        """The server session id the driver's connection ``driver`` was given at its handshake, for the
        server session's own id (``SESSION_OF``'s ``id``) to be checked against: a pooler or a proxy between
        client and server answers the handshake itself, with an id of its own, and the session behind it may
        serve other clients once this one's link is cut. None: not known."""
        return None

    def tells_sessions_apart(self, driver: Any) -> bool:
        """Whether ``SESSION_OF`` can be asked of the server behind ``driver`` at all."""
        return True

    def reply_socket(self, driver: Any) -> int | None:
        """The file descriptor of the socket under the driver's connection ``driver``, which the store shuts
        down when a reply is overdue (``_io.sync_watch_reply``); None: no socket (SQLite), or not known."""
        return None

    def classify(self, exc: DBAPIError) -> Fault:
        if exc.connection_invalidated:
            return Fault.UNAVAILABLE
        return self._classify(exc.orig)

    def _classify(self, orig: BaseException | None) -> Fault:
        return Fault.OTHER


def _missing(extra: str, module: str) -> ConfigurationError:
    return ConfigurationError(
        f"the {module} driver is not installed: pip install 'permits[{extra}]'", extra=extra, module=module
    )


def require_module(module: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise _missing(extra, module)


def dialect_for_url(url: URL) -> Dialect:
    """The dialect for a URL's backend: sqlite, mysql/mariadb, or postgresql."""
    backend = url.get_backend_name()
    if backend == "sqlite":
        from permits.dialects.sqlite import sqlite_dialect

        return sqlite_dialect()
    if backend in ("mysql", "mariadb"):
        from permits.dialects.mysql import MariaDB

        return MariaDB()
    if backend == "postgresql":
        from permits.dialects.postgresql import PostgreSQL

        return PostgreSQL()
    raise ConfigurationError(
        f"unsupported database {backend!r}: use sqlite://, mysql://, mariadb:// or postgresql://",
        backend=backend,
    )
