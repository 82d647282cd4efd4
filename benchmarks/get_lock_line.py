"""An experiment, not permits: a line for MariaDB's waiters, made of GET_LOCK (docs/benchmarks.md,
"A line for MariaDB's waiters: measured, not built").

On PostgreSQL a waiting acquire of one permit of one plain semaphore takes its turn in the semaphore's line,
an advisory lock held by the queued grant (design.md). MariaDB has named locks: a session waiting in
GET_LOCK is granted the lock in the order it asked, and a session that releases it and asks again queues
behind the sessions already waiting (measured: 0 barges in 8 and in 16 hand-offs). These systems are
permits, with the sync store patched in each client process so that on MariaDB ``queues_in_line`` answers
as on PostgreSQL (one permit of one semaphore, a seat free), and an attempt in the line goes like this:

- ``GET_LOCK_LINE`` (and ``_FAIR``): take the semaphore's named lock on a connection of its own, waiting
  up to what is left of the caller's time (within ``lock_wait_timeout``; a timeout there is a refusal);
  holding it, grant as usual, refused ask again every 1-2 ms for up to ``LINE_HEAD_WAIT_SECONDS`` as the
  queued grant does on the server (not once the request holds a place in a fair queue), then let the lock
  go. Three round trips per grant.
- ``_WHEN_CONTENDED``: the same, but only within ``CONTENDED_SECONDS`` of a refusal on the semaphore in
  this client process, or of a wait for the line longer than ``CONTENDED_LINE_WAIT``, so that an
  uncontended acquire costs one round trip.
- ``_GATED``: as ``_WHEN_CONTENDED``, and the plain grant is refused while another session holds the line,
  so that an acquire that skips the line cannot take the room the line is owed.
- ``_PIPELINED``: the named lock in one round trip, then the grant, the lock's release and the commit in
  one request on the line's connection: the line is held over one round trip instead of two. Refused, it
  does not wait at the head: it has left the line, and runs the plain attempt's slow path once.
- ``_ONE_REQUEST``: the wait in the line in that same request too, as PostgreSQL's queued grant does. Not
  safe to build as it is: a waiter killed while it waits in the line would still be granted, and hold a
  permit for nobody until its TTL (MariaDB has no ``client_connection_check_interval``).

The line is only an order of asking: capacity is still the conditional UPDATE's, and a killed holder's
session ends with its connection, which frees the named lock. Galera refuses GET_LOCK (MDEV-30473), so a
line of this kind could only serve a single server.

    cd benchmarks && python harness.py --system systems:PERMITS,get_lock_line:GET_LOCK_LINE \
        --backend mariadb --scenario hot --clients 4,16,64 --seconds 5 --warmup 1
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Sequence
from typing import Any

from harness import Scenario, connect
from pymysql.constants.CLIENT import MULTI_STATEMENTS
from systems import PermitsClient, PermitsSystem

from permits._models import Lease, ms_to_datetime
from permits._pacing import LINE_HEAD_WAIT_SECONDS, LINE_SEATS
from permits._sync import store as sync_store

_plain_try_acquire = sync_store.SQLStore.try_acquire


def _line_name(semaphore: str) -> str:
    # GET_LOCK names are at most 64 characters; a semaphore's name may be longer.
    return "permits-line:" + hashlib.sha1(semaphore.encode()).hexdigest()


class _Line:
    """The named-lock connection of one client process (each benchmark client is one thread)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: Any = None

    def take(self, semaphore: str, wait_s: float) -> bool:
        self.connect()
        cur = self.conn.cursor()
        cur.execute("SELECT GET_LOCK(%s, %s)", (_line_name(semaphore), wait_s))
        (got,) = cur.fetchone()
        return got == 1

    def connect(self) -> None:
        if self.conn is None:
            self.conn = connect(self.url, client_flag=MULTI_STATEMENTS)
            self.conn.cursor().execute("SET time_zone = '+00:00'")

    def leave(self, semaphore: str) -> None:
        self.conn.cursor().execute("DO RELEASE_LOCK(%s)", (_line_name(semaphore),))

    def grant_and_leave(self, store: Any, owner: str, key: str, want: Any, ttl_ms: int, wait_s: float = 0) -> Any:
        """``pipelined``: the grant, the line's release and the commit in one request on the line's own
        connection, so that the line is held for less than one round trip. Returns the grant's row, or None."""
        sql, names = store._driver_sql("ACQUIRE_ONE")
        assert names is None  # PyMySQL names its parameters
        params = {
            "owner": owner,
            "key": key,
            "name": want.name,
            "count": want.count,
            "ttl_ms": ttl_ms,
            "request_id": None,
            "lock_wait_s": None,
        }
        params["permits_line"] = _line_name(want.name)
        cursor = self.conn.cursor()
        # The line is let go before the COMMIT: InnoDB lets go of the row locks before it flushes the log, so
        # the next in line grants while this commit waits for the disk, and their flushes can be one.
        head, _, tail = sql.rstrip().rpartition("COMMIT")
        assert head and not tail.strip()
        enter = ""
        if _one_request:
            # The wait in the line too, as the batch's first statement. A timeout there (0) is no refusal:
            # the grant then asks outside the line, as any waiter does.
            enter = "DO GET_LOCK(%(permits_line)s, %(permits_wait)s);\n"
            params["permits_wait"] = wait_s
        cursor.execute(enter + head + "DO RELEASE_LOCK(%(permits_line)s);\nCOMMIT", params)
        result = sync_store._batch_result(cursor)
        return result.rows[0] if result.rows else None


_line: _Line | None = None
#: ``when_contended``: a semaphore's waiters go in the line only within this many seconds of a refusal of
#: this client's on it, so that uncontended acquires cost one round trip, not three
CONTENDED_SECONDS = 1.0
#: a wait for the line longer than this counts as contention, as a refusal does
CONTENDED_LINE_WAIT = 0.001
_when_contended = False
#: ``pipelined``: see ``_Line.grant_and_leave``; ``one_request``: the wait in the line in that request too
_pipelined = False
_one_request = False
_refused_at: dict[str, float] = {}


def _queues_in_line(self: Any, wants: Sequence[Any]) -> bool:
    if not (len(wants) == 1 and wants[0].count == 1 and self._in_line_now < LINE_SEATS):
        return False
    return not _when_contended or time.monotonic() - _refused_at.get(wants[0].name, -1e9) < CONTENDED_SECONDS


def _try_acquire(
    self: Any,
    owner: str,
    key: str,
    wants: Any,
    ttl_ms: int,
    wait: float = 0.0,
    recheck: bool = True,
    in_line: bool = False,
    **options: Any,  # new_only, request_id: the plain attempt's
) -> Any:
    if not in_line or _line is None or not self._take_line_seat():
        lease = _plain_try_acquire(self, owner, key, wants, ttl_ms, wait, recheck, **options)
        if lease is None:
            _refused_at[wants[0].name] = time.monotonic()
        return lease
    try:
        name = wants[0].name
        wait_s = min(wait, self._settings.lock_wait_timeout)
        entered = time.monotonic()
        if _one_request:
            _line.connect()
        elif not _line.take(name, wait_s):
            _refused_at[name] = time.monotonic()  # timed out in the line: contended
            return None
        if time.monotonic() - entered > CONTENDED_LINE_WAIT:
            _refused_at[name] = time.monotonic()  # others were ahead: the semaphore is still contended
        if _pipelined:
            row = _line.grant_and_leave(self, owner, key, wants[0], ttl_ms, wait_s)
            if row is None:
                # The slow path (why refused, a place in a fair queue) as the plain attempt runs it.
                return (
                    _plain_try_acquire(self, owner, key, wants, ttl_ms, wait, recheck, **options) if recheck else None
                )
            _, acquired_ms, expires_ms, token = row
            return Lease(
                key=key,
                owner=owner,
                counts={name: wants[0].count},
                tokens={name: int(token)},
                acquired_at=ms_to_datetime(int(acquired_ms)),
                expires_at=ms_to_datetime(int(expires_ms)),
                expires_in=(int(expires_ms) - int(acquired_ms)) / 1000,
            )
        try:
            head_until = time.monotonic() + LINE_HEAD_WAIT_SECONDS
            tries = 0
            while True:
                lease = _plain_try_acquire(self, owner, key, wants, ttl_ms, wait, recheck and tries == 0, **options)
                tries += 1
                if lease is None:
                    _refused_at[name] = time.monotonic()
                if lease is not None or time.monotonic() >= head_until or self.queue_short(owner, key):
                    return lease
                time.sleep(0.001 if tries < 10 else 0.002)
        finally:
            _line.leave(name)
    finally:
        self._leave_line_seat()


#: ``gated``: the plain grant is also refused while another session holds the semaphore's line, so that an
#: acquire that skips the line (not contended a moment ago) cannot take the room the line is owed
_GATE = (
    " AND (IS_USED_LOCK(CONCAT('permits-line:', SHA1(:name))) IS NULL"
    " OR IS_USED_LOCK(CONCAT('permits-line:', SHA1(:name))) = {holder})"
)


def _gate_grant(holder: int) -> None:
    from permits.dialects.mysql import MariaDB

    grant = MariaDB.overrides["ACQUIRE_ONE"]
    assert grant is not None and "{fair_gate};" in grant
    MariaDB.overrides = {
        **MariaDB.overrides,
        "ACQUIRE_ONE": grant.replace("{fair_gate};", "{fair_gate}" + _GATE.format(holder=holder) + ";", 1),
    }


class GetLockLineSystem(PermitsSystem):
    def __init__(
        self,
        fair: bool = False,
        when_contended: bool = False,
        gated: bool = False,
        pipelined: bool = False,
        one_request: bool = False,
    ) -> None:
        super().__init__(fair)
        self.when_contended = when_contended
        self.gated = gated
        self.pipelined = pipelined or one_request
        self.one_request = one_request
        self.name = (
            "get-lock-line"
            + ("-fair" if fair else "")
            + ("-when-contended" if when_contended else "")
            + ("-gated" if gated else "")
            + ("-pipelined" if pipelined else "")
            + ("-one-request" if one_request else "")
        )

    def load_history(self, backend_url: str, scenario: Scenario, rows: int) -> None:
        raise NotImplementedError("the experiment measures an empty history only")

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> PermitsClient:
        global _line, _when_contended, _pipelined, _one_request
        _line = _Line(backend_url)
        _when_contended, _pipelined, _one_request = self.when_contended, self.pipelined, self.one_request
        if self.gated:
            _line.take("", 0)  # connects
            _line.leave("")
            cur = _line.conn.cursor()
            cur.execute("SELECT CONNECTION_ID()")
            _gate_grant(int(cur.fetchone()[0]))
        sync_store.SQLStore.queues_in_line = _queues_in_line  # type: ignore[method-assign]
        sync_store.SQLStore.try_acquire = _try_acquire  # type: ignore[method-assign]
        random.seed(client_index)
        return PermitsClient(backend_url, scenario.semaphores_for(client_index))


GET_LOCK_LINE = GetLockLineSystem()
GET_LOCK_LINE_FAIR = GetLockLineSystem(fair=True)
GET_LOCK_LINE_WHEN_CONTENDED = GetLockLineSystem(when_contended=True)
GET_LOCK_LINE_FAIR_WHEN_CONTENDED = GetLockLineSystem(fair=True, when_contended=True)
GET_LOCK_LINE_GATED = GetLockLineSystem(when_contended=True, gated=True)
GET_LOCK_LINE_FAIR_GATED = GetLockLineSystem(fair=True, when_contended=True, gated=True)
GET_LOCK_LINE_PIPELINED = GetLockLineSystem(pipelined=True)
GET_LOCK_LINE_FAIR_PIPELINED = GetLockLineSystem(fair=True, pipelined=True)
GET_LOCK_LINE_ONE_REQUEST = GetLockLineSystem(one_request=True)
GET_LOCK_LINE_FAIR_ONE_REQUEST = GetLockLineSystem(fair=True, one_request=True)
