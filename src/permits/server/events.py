"""The dashboard's live feed: grants, lease endings, capacity changes and admin actions, read from the
database, so a page sees what every instance and every library client did.

A cursor names a position in all four sources at once, in database values only
(``g<lease id>.e<ended_at_ms>.c<change id>.a<admin log id>``), so a stream resumed with its last cursor
(``since=``, or the browser's ``Last-Event-ID``) carries on from the same place on any instance.

Each instance polls once per ``poll_interval`` while it has subscribers, however many: the load on the
database grows with instances, not with open pages. Keys of other owners' leases are hidden per
subscriber, as in the holders list.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from permits._core.flows import Flow, Stmt
from permits._exceptions import InvalidArgument, LimitExceeded
from permits._models import ms_to_datetime
from permits.server.auth import Identity

logger = logging.getLogger("permits.server.events")

#: Rows read per source per poll; a busier feed is summarised (see ``Batch.skipped``).
MAX_ROWS_PER_POLL = 500
#: A grant is listed once this old: its lease id was taken before it committed, so a lower id may still
#: be in flight when a higher one is already visible.
SETTLE_MS = 300
#: Endings are re-read this far back (an ending's time is its statement's, before its commit) and those
#: already sent are dropped.
ENDS_OVERLAP_MS = 2000
#: Events a subscriber may fall behind by before it is told to resync.
SUBSCRIBER_BACKLOG = 1000
#: The service's own maintenance leases (taken every few seconds to elect a sweeper) would drown the
#: feed; their semaphores still show on the overview.
INTERNAL_PREFIX = "permits:maintenance:"
_CURSOR = re.compile(r"g([0-9]{1,19})\.e([0-9]{1,19})\.c([0-9]{1,19})\.a([0-9]{1,19})")
MAX_CURSOR_PART = 2**63 - 1


@dataclass(frozen=True)
class Cursor:
    lease_id: int
    ended_ms: int
    change_id: int
    admin_id: int

    def __str__(self) -> str:
        return f"g{self.lease_id}.e{self.ended_ms}.c{self.change_id}.a{self.admin_id}"

    @classmethod
    def parse(cls, text: str, field: str = "since") -> Cursor:
        """``text`` as a cursor; ``field``: where it came from, for the error that names it."""
        found = _CURSOR.fullmatch(text)
        parts = [] if found is None else [int(part) for part in found.groups()]
        # Nineteen digits can still overflow the signed 64-bit columns they are compared with.
        if found is None or max(parts) > MAX_CURSOR_PART:
            raise InvalidArgument("not an event cursor: use the cursor an event feed gave", field=field)
        return cls(*parts)


@dataclass
class Batch:
    cursor: Cursor
    events: list[dict[str, Any]]
    #: a source had more than MAX_ROWS_PER_POLL rows: the feed skipped ahead
    skipped: bool = False


def head() -> Flow[Cursor]:
    """Where a feed starts: after everything that exists now."""
    found = yield Stmt("EVENTS_HEAD")
    lease_id, change_id, admin_id, now_ms = (int(v) for v in found.rows[0])
    return Cursor(lease_id, now_ms, change_id, admin_id)


def earliest(a: Cursor, b: Cursor) -> Cursor:
    """The position that is at or before both ``a`` and ``b`` in every source (pure)."""
    return Cursor(
        min(a.lease_id, b.lease_id),
        min(a.ended_ms, b.ended_ms),
        min(a.change_id, b.change_id),
        min(a.admin_id, b.admin_id),
    )


def read_since(cursor: Cursor, sent_ends: Sequence[int] = ()) -> Flow[Batch]:
    """Everything after ``cursor``. ``sent_ends``: ids of leases whose ending was already sent."""
    limit = MAX_ROWS_PER_POLL
    grants = yield Stmt("EVENTS_GRANTS", {"after": cursor.lease_id, "settle_ms": SETTLE_MS, "limit": limit})
    ends = yield Stmt("EVENTS_ENDS", {"since_ms": cursor.ended_ms - ENDS_OVERLAP_MS, "limit": limit})
    changes = yield Stmt("EVENTS_CHANGES", {"after": cursor.change_id, "limit": limit})
    admin = yield Stmt("EVENTS_ADMIN", {"after": cursor.admin_id, "limit": limit})
    return assemble(cursor, grants.rows, ends.rows, changes.rows, admin.rows, set(sent_ends))


def assemble(
    cursor: Cursor,
    grants: Sequence[Sequence[Any]],
    ends: Sequence[Sequence[Any]],
    changes: Sequence[Sequence[Any]],
    admin: Sequence[Sequence[Any]],
    sent_ends: set[int],
) -> Batch:
    """The events of one poll, in time order, and the cursor after them (pure)."""
    skipped = any(len(rows) >= MAX_ROWS_PER_POLL for rows in (grants, ends, changes, admin))
    events: list[tuple[int, dict[str, Any]]] = []
    lease_id, ended_ms, change_id, admin_id = cursor.lease_id, cursor.ended_ms, cursor.change_id, cursor.admin_id
    # A lease's rows (one per semaphore) arrive together; at a limit, the last lease may be cut: drop it,
    # unless it is the only one, and take it whole next time.
    by_lease: OrderedDict[int, list[Sequence[Any]]] = OrderedDict()
    for row in grants:
        by_lease.setdefault(int(row[0]), []).append(row)
    if len(grants) >= MAX_ROWS_PER_POLL and len(by_lease) > 1:
        by_lease.popitem()
    for lid, rows in by_lease.items():
        lease_id = max(lease_id, lid)
        if _internal(rows, 4):
            continue
        _, owner, key, at_ms = rows[0][:4]
        permits = [{"name": str(r[4]), "count": int(r[5]), "token": str(r[6])} for r in rows]
        event = {"type": "grant", "at_ms": int(at_ms), "lease_id": lid, "owner": str(owner), "key": str(key)}
        events.append((int(at_ms), {**event, "names": [p["name"] for p in permits], "permits": permits}))
    ended: OrderedDict[int, list[Sequence[Any]]] = OrderedDict()
    for row in ends:
        if int(row[0]) not in sent_ends:
            ended.setdefault(int(row[0]), []).append(row)
    if len(ends) >= MAX_ROWS_PER_POLL and len(ended) > 1:
        ended.popitem()
    for lid, rows in ended.items():
        _, owner, key, at_ms, reason, note = rows[0][:6]
        ended_ms = max(ended_ms, int(at_ms))
        if _internal(rows, 6):
            continue
        permits = [{"name": str(r[6]), "count": int(r[7]), "token": str(r[8])} for r in rows]
        event = {
            "type": "end",
            "at_ms": int(at_ms),
            "lease_id": lid,
            "owner": str(owner),
            "key": str(key),
            "reason": None if reason is None else str(reason),
            "note": None if note is None else str(note),
        }
        events.append((int(at_ms), {**event, "names": [p["name"] for p in permits], "permits": permits}))
    for cid, name, old, new, by, reason, at_ms in changes:
        event = {
            "type": "capacity",
            "change_id": int(cid),
            "at_ms": int(at_ms),
            "names": [str(name)],
            "name": str(name),
            "old_capacity": None if old is None else int(old),
            "new_capacity": int(new),
            "changed_by": str(by),
            "reason": str(reason),
        }
        events.append((int(at_ms), event))
        change_id = max(change_id, int(cid))
    for aid, at_ms, actor, action, name, lease_owner, lease_key, reason, detail in admin:
        event = {
            "type": "admin",
            "admin_id": int(aid),
            "at_ms": int(at_ms),
            "names": [] if name is None else [str(name)],
            "actor": str(actor),
            "action": str(action),
            "name": None if name is None else str(name),
            "owner": None if lease_owner is None else str(lease_owner),
            "key": None if lease_key is None else str(lease_key),
            "reason": str(reason),
            "detail": None if detail is None else str(detail),
        }
        events.append((int(at_ms), event))
        admin_id = max(admin_id, int(aid))
    events.sort(key=lambda pair: pair[0])
    if skipped:
        # More happened than one read lists: say so, so that a page reloads what it shows.
        at = events[-1][0] if events else cursor.ended_ms
        events.append((at, {"type": "resync", "at_ms": at, "names": [], "note": "too many events to list"}))
    return Batch(Cursor(lease_id, ended_ms, change_id, admin_id), [e for _, e in events], skipped)


def _internal(rows: Sequence[Sequence[Any]], name_column: int) -> bool:
    return all(str(r[name_column]).startswith(INTERNAL_PREFIX) for r in rows)


def shown_to(event: dict[str, Any], identity: Identity) -> dict[str, Any]:
    """The event as ``identity`` may see it: another owner's lease key is hidden unless it is an admin."""
    if "key" not in event or event.get("owner") is None or identity.admin or identity.owns(event["owner"]):
        return with_time(event)
    return with_time({**event, "key": None})


def with_time(event: dict[str, Any]) -> dict[str, Any]:
    return {**event, "at": ms_to_datetime(int(event["at_ms"])).isoformat()}


@dataclass(eq=False)  # compared and hashed by identity: a set holds them
class _Subscriber:
    identity: Identity
    queue: asyncio.Queue[tuple[str, list[dict[str, Any]]] | None] = field(
        default_factory=lambda: asyncio.Queue(maxsize=SUBSCRIBER_BACKLOG)
    )


@dataclass(eq=False)
class _Joining:
    """A stream waiting for the poller to catch it up and let it in."""

    subscriber: _Subscriber
    since: Cursor
    admitted: asyncio.Future[None]


class Broadcaster:
    """One poller per instance, started by the first subscriber and stopped with the last.

    The poller also catches each newcomer up, between two of its polls: a catch-up read beside the polls
    could end before an event that a poll then sent to the others only, before the newcomer was listening.
    """

    def __init__(self, store: Any, poll_interval: float, max_streams: int) -> None:
        self._store = store
        self._poll_interval = poll_interval
        self._max_streams = max_streams
        self._subscribers: set[_Subscriber] = set()
        self._joining: list[_Joining] = []
        #: the newcomers the poller is catching up now
        self._admitting: list[_Joining] = []
        self._task: asyncio.Task[None] | None = None
        self._cursor: Cursor | None = None
        #: lease ids whose ending was sent, with their end time, kept for the re-read overlap
        self._sent_ends: dict[int, int] = {}
        self._newcomer = asyncio.Event()

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    async def subscribe(self, identity: Identity, since: Cursor) -> _Subscriber:
        """Join the feed after ``since``: returns once the subscriber's queue holds what it missed and it
        hears every later poll. A failed catch-up read raises here, and the stream is not opened."""
        if len(self._subscribers) + len(self._joining) + len(self._admitting) >= self._max_streams:
            raise LimitExceeded(f"{self._max_streams} event streams are open on this instance", limit="max_streams")
        joining = _Joining(_Subscriber(identity), since, asyncio.get_running_loop().create_future())
        self._joining.append(joining)
        self._newcomer.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll(), name="permits-events")
        try:
            await joining.admitted
        except BaseException:
            # The caller went away (or the read failed) while it waited: it never listens.
            with contextlib.suppress(ValueError):
                self._joining.remove(joining)
            self._subscribers.discard(joining.subscriber)
            raise
        return joining.subscriber

    def unsubscribe(self, subscriber: _Subscriber) -> None:
        self._subscribers.discard(subscriber)

    def end_streams(self) -> None:
        """Tell every open stream to end (a shutdown began): uvicorn waits for open responses before it
        shuts the app down, and a stream that went on would hold the process up for the whole grace."""
        for joining in self._joining + self._admitting:
            joining.subscriber.queue.put_nowait(None)
            if not joining.admitted.done():
                joining.admitted.set_result(None)  # the stream opens and ends at once; never listed
        self._joining.clear()
        for subscriber in list(self._subscribers):
            with contextlib.suppress(asyncio.QueueEmpty):
                subscriber.queue.get_nowait()  # room for the end, even in a full backlog
            with contextlib.suppress(asyncio.QueueFull):
                subscriber.queue.put_nowait(None)

    async def close(self) -> None:
        self.end_streams()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        next_poll = loop.time() + self._poll_interval
        try:
            while self._subscribers or self._joining:
                if not self._joining:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._newcomer.wait(), max(0.0, next_poll - loop.time()))
                self._newcomer.clear()
                if self._joining:
                    await self._admit()
                # On time however many newcomers come: they must not hold the others' events up.
                if loop.time() >= next_poll:
                    next_poll = loop.time() + self._poll_interval
                    await self._poll_once()
        finally:
            self._task = None
            for joining in self._joining + self._admitting:  # cancelled: no newcomer may hang
                if not joining.admitted.done():
                    joining.admitted.cancel()

    async def _poll_once(self) -> None:
        cursor = self._cursor
        if cursor is None:
            return
        try:
            sent = list(self._sent_ends)
            batch = await self._store.run_flow(lambda: read_since(cursor, sent), readonly=True)
        except Exception as exc:  # the feed carries on at the next poll, whatever stopped this one
            logger.warning("event feed: the database did not answer: %s", exc)
            return
        self._remember_ends(batch)
        self._cursor = batch.cursor
        if not batch.events:
            return
        for subscriber in list(self._subscribers):
            try:
                subscriber.queue.put_nowait((str(batch.cursor), batch.events))
            except asyncio.QueueFull:
                # Too slow to keep up: end its stream; the page reconnects from its last cursor.
                self._subscribers.discard(subscriber)
                with contextlib.suppress(asyncio.QueueEmpty):
                    subscriber.queue.get_nowait()
                subscriber.queue.put_nowait(None)

    async def _admit(self) -> None:
        """Catch the newcomers up and let them in. No poll runs meanwhile, so each one's catch-up, read
        after the last poll, reaches at least as far as the shared position, from which the next poll
        goes on: a newcomer may get an event twice (pages drop repeats by their ids), never miss one.

        The shared position does not move on a newcomer's account while others listen: they would skip
        what lies between. With nobody listening it is set to where the newcomers' catch-ups ended: left
        where the last stream closed, it would send them everything that happened while no page was open.
        Never past the database's head, though (a cursor is the caller's to give, and a restored database
        may be behind it), nor in the middle of a history too long to catch up on in one read."""
        joining, self._joining = self._joining, []
        self._admitting = joining  # still counted, and still told of a shutdown, while they catch up
        try:
            await self._catch_up(joining)
        finally:
            self._admitting = []
            for newcomer in joining:  # cancelled half-way: none may hang
                if not newcomer.admitted.done():
                    newcomer.admitted.cancel()

    async def _catch_up(self, joining: list[_Joining]) -> None:
        listened = bool(self._subscribers)
        ends: list[Cursor] = []
        admitted: list[_Joining] = []
        for newcomer in joining:
            if newcomer.admitted.done():  # its caller went away
                continue
            try:
                # Not the endings sent to the others: the newcomer has not seen them.
                catch_up = await self._store.run_flow(lambda j=newcomer: read_since(j.since), readonly=True)
                now = None if listened else await self._store.run_flow(head, readonly=True)
            except Exception as exc:  # this newcomer's stream is not opened; the others go on
                if not newcomer.admitted.done():
                    newcomer.admitted.set_exception(exc)
                continue
            if catch_up.events:
                newcomer.subscriber.queue.put_nowait((str(catch_up.cursor), catch_up.events))
            if now is not None:
                ends.append(now if catch_up.skipped else earliest(catch_up.cursor, now))
            admitted.append(newcomer)
        if ends:
            position = ends[0]
            for end in ends[1:]:
                position = earliest(position, end)
            self._cursor = position
            self._sent_ends.clear()  # re-sent endings of the overlap are repeats, which pages drop
        for newcomer in admitted:
            if not newcomer.admitted.done():
                self._subscribers.add(newcomer.subscriber)
                newcomer.admitted.set_result(None)

    def _remember_ends(self, batch: Batch) -> None:
        for event in batch.events:
            if event["type"] == "end":
                self._sent_ends[int(event["lease_id"])] = int(event["at_ms"])
        horizon = batch.cursor.ended_ms - 2 * ENDS_OVERLAP_MS
        for lease_id in [i for i, at in self._sent_ends.items() if at < horizon]:
            del self._sent_ends[lease_id]
