"""The dashboard's event feed, driven in process against a real database: the interleavings of a poll and
a newcomer's catch-up that a running service only hits by chance."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import permits
from permits._config import Settings
from permits._core.flows import Flow
from permits._exceptions import LimitExceeded
from permits.server.auth import Identity
from permits.server.events import Broadcaster, Cursor, head
from permits.stores import async_sql_store

ADMIN = Identity("admin", admin=True, scoped=False)


class _CatchUpPaused:
    """The store, holding back one answer: that of the first feed read from ``since`` once armed. The read
    has run when it stops; it is the caller that waits."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.since: Cursor | None = None
        self.read_ran = asyncio.Event()
        self.resume = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def run_flow(self, make_flow: Callable[[], Flow[Any]], readonly: bool = False) -> Any:
        result = await self._store.run_flow(make_flow, readonly=readonly)
        if self.since is not None and _reads_from(make_flow, self.since):
            self.since = None
            self.read_ran.set()
            await self.resume.wait()
        return result


async def _open_store(db_url: str) -> Any:
    """The asyncio SQL store a service instance would give its feed."""
    settings = Settings.build(db_url, owner="feed-test", ttl=60, lock_wait_timeout=5, retries=3, auto_upgrade=None)
    store = async_sql_store(settings)
    await store.open()
    return store


async def _paused_feed(db_url: str, max_streams: int) -> tuple[Any, _CatchUpPaused, Broadcaster]:
    """A store, the same with one catch-up held back, and a feed polling through the latter."""
    store = await _open_store(db_url)
    paused = _CatchUpPaused(store)
    return store, paused, Broadcaster(paused, poll_interval=0.05, max_streams=max_streams)


def _reads_from(make_flow: Callable[[], Flow[Any]], since: Cursor) -> bool:
    flow = make_flow()
    first = next(flow)
    flow.close()
    return first.name == "EVENTS_GRANTS" and first.params["after"] == since.lease_id  # type: ignore[call-overload]


async def _grants_until(queue: asyncio.Queue[Any], token: int, seconds: float) -> list[int]:
    """The grant tokens a subscriber gets until ``token`` is among them, or ``seconds`` pass."""
    tokens: list[int] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while token not in tokens and loop.time() < deadline:
        try:
            item = await asyncio.wait_for(queue.get(), deadline - loop.time())
        except TimeoutError:
            break
        assert item is not None, "the stream was ended"
        tokens += [int(p["token"]) for e in item[1] if e["type"] == "grant" for p in e["permits"]]
    return tokens


def test_a_newcomer_gets_what_a_poll_sent_the_others_while_it_caught_up(db_url: str, ns: str) -> None:
    """A page joins while another listens. Its catch-up read ends; then a lease is granted, and the poll
    that lists it would go to the pages already listening. The newcomer still gets that grant (before the
    fix it got it only if its catch-up happened to list it), and what it missed before joining."""
    name = f"{ns}feed"
    with permits.connect(db_url, owner=f"feed-{uuid.uuid4().hex[:6]}") as client:
        client.create_semaphore(name, 5)

        def grant() -> int:
            lease = client.acquire(name, ttl=60)
            return int(lease.tokens[name])

        async def scenario() -> None:
            store, paused, feed = await _paused_feed(db_url, max_streams=10)
            try:
                start = await store.run_flow(head, readonly=True)
                listening = await feed.subscribe(ADMIN, start)
                before = await asyncio.to_thread(grant)
                assert before in await _grants_until(listening.queue, before, 10)

                paused.since = start
                joining = asyncio.create_task(feed.subscribe(ADMIN, start))
                await asyncio.wait_for(paused.read_ran.wait(), 10)
                during = await asyncio.to_thread(grant)
                # Long enough for a poll beside the catch-up to list it (grants settle for 0.3 s first).
                seen_by_first = await _grants_until(listening.queue, during, 1.5)
                paused.resume.set()
                newcomer = await asyncio.wait_for(joining, 10)

                got = await _grants_until(newcomer.queue, during, 10)
                assert before in got and during in got, got
                if during not in seen_by_first:
                    assert during in await _grants_until(listening.queue, during, 10)
            finally:
                await feed.close()
                await store.close()

        asyncio.run(scenario())


def test_a_newcomer_gets_the_endings_already_sent_to_the_others(db_url: str, ns: str) -> None:
    """A lease ends while one page listens; a page joins later from a cursor before that ending. Its
    catch-up lists the ending (before the fix it was dropped, as one the instance had already sent)."""
    name = f"{ns}ends"
    with permits.connect(db_url, owner=f"feed-{uuid.uuid4().hex[:6]}") as client:
        client.create_semaphore(name, 5)

        async def ends_until(queue: asyncio.Queue[Any], key: str, seconds: float) -> bool:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + seconds
            while loop.time() < deadline:
                try:
                    item = await asyncio.wait_for(queue.get(), deadline - loop.time())
                except TimeoutError:
                    return False
                if any(e["type"] == "end" and e["key"] == key for e in item[1]):
                    return True
            return False

        async def scenario() -> None:
            store = await _open_store(db_url)
            feed = Broadcaster(store, poll_interval=0.05, max_streams=10)
            try:
                start = await store.run_flow(head, readonly=True)
                listening = await feed.subscribe(ADMIN, start)
                lease = await asyncio.to_thread(client.acquire, name, ttl=60)
                await asyncio.to_thread(client.release, lease)
                assert await ends_until(listening.queue, lease.key, 10)
                newcomer = await feed.subscribe(ADMIN, start)
                assert await ends_until(newcomer.queue, lease.key, 3)
            finally:
                await feed.close()
                await store.close()

        asyncio.run(scenario())


def test_newcomers_arriving_faster_than_the_poll_interval_do_not_hold_up_the_feed(db_url: str, ns: str) -> None:
    """Pages keep opening (reloads, a script reconnecting in a loop) faster than the instance polls: the
    pages already open still get each event within about a poll interval."""
    name = f"{ns}busy"
    with permits.connect(db_url, owner=f"feed-{uuid.uuid4().hex[:6]}") as client:
        client.create_semaphore(name, 5)

        async def scenario() -> None:
            store = await _open_store(db_url)
            feed = Broadcaster(store, poll_interval=0.5, max_streams=1000)
            stop = asyncio.Event()

            async def keep_joining() -> None:
                start = await store.run_flow(head, readonly=True)
                while not stop.is_set():
                    feed.unsubscribe(await feed.subscribe(ADMIN, start))
                    await asyncio.sleep(0.05)

            try:
                listening = await feed.subscribe(ADMIN, await store.run_flow(head, readonly=True))
                joiner = asyncio.create_task(keep_joining())
                await asyncio.sleep(0.3)
                lease = await asyncio.to_thread(client.acquire, name, ttl=60)
                # Listed once 0.3 s old, at the next poll: within about a second, newcomers or not.
                assert lease.tokens[name] in await _grants_until(listening.queue, lease.tokens[name], 3)
                stop.set()
                await joiner
            finally:
                stop.set()
                await feed.close()
                await store.close()

        asyncio.run(scenario())


def test_a_newcomer_caught_up_when_the_instance_stops_is_not_left_waiting(db_url: str) -> None:
    """A shutdown that begins while a page is being caught up ends that page's stream at once, and closing
    the feed then leaves no request waiting (before, the newcomer was on no list while it caught up)."""

    async def scenario() -> None:
        store, paused, feed = await _paused_feed(db_url, max_streams=1)
        try:
            start = await store.run_flow(head, readonly=True)
            paused.since = start
            joining = asyncio.create_task(feed.subscribe(ADMIN, start))
            await asyncio.wait_for(paused.read_ran.wait(), 10)
            # Still counted against the limit while it catches up:
            with pytest.raises(LimitExceeded):
                await feed.subscribe(ADMIN, start)
            feed.end_streams()
            newcomer = await asyncio.wait_for(joining, 2)
            assert newcomer.queue.get_nowait() is None  # its stream ends at once
            await asyncio.wait_for(feed.close(), 5)
            assert feed.subscribers == 0
        finally:
            paused.resume.set()
            await feed.close()
            await store.close()

    asyncio.run(scenario())


def test_a_stream_whose_headers_never_went_out_lets_its_subscription_go(tmp_path: Path) -> None:
    """The stream subscribes before its response starts (a 429 must come before the headers). A client
    gone while the headers are sent ends the response before its generator starts, whose own clean-up then
    never runs: the response lets the subscription go itself, or every such client would hold one of the
    instance's ``max_streams`` until it restarts. In process, the ASGI way: the server's send fails."""
    from permits.server import ServerConfig, create_app

    async def scenario() -> int:
        config = ServerConfig(database_url=f"sqlite:///{tmp_path / 'p.db'}", maintenance={"enabled": False})
        app = create_app(config)
        async with app.router.lifespan_context(app):
            broadcaster = app.state.permits.broadcaster

            received: list[bool] = []

            async def receive() -> dict[str, Any]:
                if received:
                    await asyncio.Event().wait()  # as a server's: nothing more until the client goes
                received.append(True)
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    raise OSError("the client went away")

            scope = {
                "type": "http",
                "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": "1.1",
                "method": "GET",
                "scheme": "http",
                "path": "/v1/events/stream",
                "raw_path": b"/v1/events/stream",
                "root_path": "",
                "query_string": b"",
                "headers": [(b"host", b"permits.test")],
                "client": ("127.0.0.1", 1),
                "server": ("127.0.0.1", 80),
            }
            with contextlib.suppress(OSError):
                await app(scope, receive, send)
            return len(broadcaster._subscribers)

    assert asyncio.run(scenario()) == 0
