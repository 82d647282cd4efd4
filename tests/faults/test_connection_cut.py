"""An acquire retried with the same key, including after the connection drops before the reply: never two
grants.

The client under test talks to the server through ``tests._proxy.CuttingProxy``, which cuts the
connection at a chosen point of the exchange: after the server has sent N more bytes (a sweep over the
whole reply stream of one acquire, up to and including the reply to COMMIT), or after the client's Nth
packet (the request reached the server, its reply never comes back). The store retries a lost connection
on a fresh one with the same key; when it gives up (``StorageUnavailable``), the caller calls again once
the network is back. Either way the key must end up granted exactly once. The checks go to the server
directly, not through the proxy.

A link can also stall without failing: no byte lost, none delivered, no error at either end (a hung
proxy, a NAT entry that dropped the flow, a frozen server). TCP alone would hold the caller until it gave
up, about 15 minutes later; the store bounds each wait for a reply (``Settings.reply_timeout``) and each
new connection, so the caller gets ``StorageUnavailable`` in bounded time and asks again with the same key
once the link is back: the key is then granted once, whether or not the stalled statement ran.

SQLite has no connection to cut: these tests run on MariaDB and PostgreSQL.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest

import permits
from permits import ReleaseOutcome, StorageUnavailable
from permits._schema import VERSION_TABLE
from tests._proxy import CuttingProxy
from tests._service import running, wait_until
from tests.conftest import THOROUGH, AsyncFacade

T = TypeVar("T")

#: Each test cuts or stalls only its own proxy's links, and its time bounds allow for a loaded machine
#: (BOUND): they run beside the other tests, not alone as the rest of tests/faults does.
pytestmark = [pytest.mark.beside_others, pytest.mark.waits]

#: every STRIDE-th byte of the reply stream is a cut point, and every one of the first HEAD and last TAIL
STRIDE = 11
HEAD = 8
TAIL = 32
SHAPES = {"one": {"a": 1}, "two": {"a": 1, "b": 2}}
#: tight: the lease fills its semaphores, so a retry finds no room and must look the key up; roomy: a retry
#: finds room, takes it, and must give it back when its insert hits the key
ROOMS = {"tight": 0, "roomy": 2}


@pytest.fixture(params=["mysql", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    """Overrides the conftest fixture: only the servers have a connection to cut."""
    return str(request.param)


@pytest.fixture
def proxy(db_url: str) -> Iterator[CuttingProxy]:
    with CuttingProxy.before(db_url) as running:
        yield running


class _Bench:
    """A client through the proxy, a direct one for the checks, and the semaphores of one test."""

    def __init__(self, db_url: str, proxy: CuttingProxy, ns: str, shape: str, room: str) -> None:
        self.proxy = proxy
        self.ns = ns
        self.owner = f"{ns}owner"
        self.wants = {f"{ns}{s}": n for s, n in SHAPES[shape].items()}
        self.names = sorted(self.wants)
        self.direct = permits.connect(db_url, owner=self.owner)
        self.client = permits.connect(proxy.url_for(db_url), owner=self.owner)
        for name, count in self.wants.items():
            self.direct.create_semaphore(name, count + ROOMS[room])
        self.client.get_semaphore(self.names[0])  # the pooled connection is open and warm

    def close(self) -> None:
        self.proxy.heal()
        self.client.close()
        self.direct.close()

    def measure(self, runs: int = 8) -> tuple[int, int]:
        """The fewest server bytes and client packets one undisturbed acquire took, over a few runs (psycopg
        prepares a statement after its fifth run, which shortens the exchange)."""
        sizes: list[tuple[int, int]] = []
        for i in range(runs):
            bytes0, packets0 = self.proxy.server_bytes, self.proxy.client_packets
            lease = self.client.acquire(self.wants, key=f"{self.ns}probe{i}", timeout=5)
            sizes.append((self.proxy.server_bytes - bytes0, self.proxy.client_packets - packets0))
            assert self.client.release(lease) == ReleaseOutcome.RELEASED
        return min(s for s, _ in sizes), min(p for _, p in sizes)

    def acquire_through_cuts(self, key: str) -> tuple[permits.Lease, bool]:
        """Acquire under ``key`` while the proxy cuts; if the store gives up, heal and call again.
        Returns the lease and whether the store gave up once. (A waiting acquire rides out a lost link
        within its timeout, and gives up only at its end: a short one keeps the hopeless cut points quick.)"""
        try:
            lease = self.client.acquire(self.wants, key=key, timeout=2.5)
            gave_up = False
        except StorageUnavailable:
            self.proxy.heal()
            lease = self.client.acquire(self.wants, key=key, timeout=5)
            gave_up = True
        self.proxy.heal()
        return lease, gave_up

    def assert_granted_once(self, key: str, lease: permits.Lease, tokens_before: dict[str, int], where: str) -> None:
        direct = self.direct
        try:
            assert lease.key == key and lease.owner == self.owner
            assert lease.counts == self.wants
            assert lease.held
            stored = direct.get_lease(key)
            assert stored.end_reason is None
            assert stored.tokens == lease.tokens, "the reply's tokens are not the stored lease's"
            for name in self.names:
                sem = direct.get_semaphore(name)
                assert sem.used == self.wants[name], f"{name}: {sem.used} permits used, granted {self.wants[name]}"
                assert [h.key for h in direct.holders(name)] == [key]
                # One grant took one token: the lease's, and nothing after it.
                assert lease.tokens[name] == tokens_before[name] + 1
                assert sem.last_token == lease.tokens[name]
            assert direct.reconcile() == []
            # Asking again, through the healed proxy, answers with the same lease.
            again = self.client.acquire(self.wants, key=key, timeout=5)
            assert again.tokens == lease.tokens
            assert direct.get_semaphore(self.names[0]).used == self.wants[self.names[0]]
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from exc
        assert direct.release(key) == ReleaseOutcome.RELEASED
        assert all(direct.get_semaphore(name).used == 0 for name in self.names)

    def last_tokens(self) -> dict[str, int]:
        return {name: self.direct.get_semaphore(name).last_token for name in self.names}

    def through_cut(self, kind: str, n: int, call: Callable[[], T]) -> T:
        """``call()`` with the proxy set to cut after ``n`` server bytes (``kind`` "bytes") or client packets
        ("packets"); if the store gives up, heal and call again. The proxy is healed after."""
        if kind == "bytes":
            self.proxy.cut_after_server_bytes(n)
        else:
            self.proxy.cut_after_client_packets(n)
        try:
            return call()
        except StorageUnavailable:
            self.proxy.heal()
            return call()
        finally:
            self.proxy.heal()


@pytest.mark.slow
@pytest.mark.parametrize("room", list(ROOMS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cut_anywhere_in_one_acquire(db_url: str, proxy: CuttingProxy, ns: str, shape: str, room: str) -> None:
    bench = _Bench(db_url, proxy, ns, shape, room)
    try:
        size, packets = bench.measure()
        assert size > 0 and packets > 0

        # The server's replies, cut after n bytes, for n across the whole acquire.
        points = set(range(0, size, STRIDE)) | set(range(min(HEAD, size))) | set(range(max(0, size - TAIL), size))
        for n in sorted(points):
            key = f"{ns}bytes{n}"
            before = bench.last_tokens()
            cuts = proxy.cuts
            proxy.cut_after_server_bytes(n)
            lease, _ = bench.acquire_through_cuts(key)
            assert proxy.cuts == cuts + 1, f"no cut after {n} of {size} bytes"
            bench.assert_granted_once(key, lease, before, f"cut after {n} of {size} server bytes")

        # The client's requests reach the server, and the connection drops before the reply. (How psycopg's
        # pipeline splits into packets varies from run to run: a cut point past the end is just not hit.)
        for m in range(1, packets + 1):
            key = f"{ns}packets{m}"
            before = bench.last_tokens()
            cuts = proxy.cuts
            proxy.cut_after_client_packets(m)
            lease, _ = bench.acquire_through_cuts(key)
            assert m > 1 or proxy.cuts == cuts + 1, "no cut after the first client packet"
            bench.assert_granted_once(key, lease, before, f"cut after client packet {m} of about {packets}")
    finally:
        bench.close()


@pytest.mark.slow
def test_a_request_for_a_new_lease_only_cut_anywhere_is_granted_exactly_once(
    db_url: str, proxy: CuttingProxy, ns: str
) -> None:
    """``new_only``, alone under its key, cut anywhere: it is granted, exactly once, and answered with its
    lease, never refused as if another request held the key (``KeyInUse``). A retry that finds a lease under
    the key after a lost connection knows it as its own by the request id the lease records (migration
    0009); before, such a retry could only say that the outcome was unknown."""
    bench = _Bench(db_url, proxy, ns, "one", "roomy")
    try:
        size, packets = bench.measure()
        points = set(range(0, size, STRIDE)) | set(range(max(0, size - TAIL), size))
        cuts = [("bytes", n) for n in sorted(points)] + [("packets", m) for m in range(1, packets + 1)]
        for kind, n in cuts:
            key = f"{ns}new-{kind}{n}"
            before = bench.last_tokens()
            if kind == "bytes":
                proxy.cut_after_server_bytes(n)
            else:
                proxy.cut_after_client_packets(n)
            try:
                lease = bench.client.acquire(bench.wants, key=key, timeout=5, new_only=True)
            finally:
                proxy.heal()
            name = bench.names[0]
            stored = bench.direct.get_lease(key)
            assert lease.tokens == stored.tokens, f"{kind} {n}"
            assert stored.tokens[name] == before[name] + 1 and stored.held, f"{kind} {n}: not granted once"
            assert bench.direct.release(key) == ReleaseOutcome.RELEASED
    finally:
        bench.close()


@pytest.mark.slow
def test_every_connection_cut_until_the_network_heals(db_url: str, proxy: CuttingProxy, ns: str) -> None:
    """Every connection, new ones included, is cut at the same point, so the store's retries fail too and
    it gives up with StorageUnavailable; the call repeated after the network heals grants exactly once."""
    bench = _Bench(db_url, proxy, ns, "two", "tight")
    try:
        size, packets = bench.measure(runs=2)
        # What a new connection costs before its first statement (greeting, authentication, session set-up):
        # the same read on a connection the proxy has just dropped (the store reconnects) and on a warm one.
        reads = []
        for drop in (False, True):
            if drop:
                proxy.cut_all()
            bytes0, packets0 = proxy.server_bytes, proxy.client_packets
            bench.client.get_semaphore(bench.names[0])
            reads.append((proxy.server_bytes - bytes0, proxy.client_packets - packets0))
        # a new connection's whole exchange, up to the acquire's last reply or request
        span = reads[1][0] - reads[0][0] + size
        requests = reads[1][1] - reads[0][1] + packets
        assert span > size and requests > packets
        # Or, where the first attempt went through but its reply was cut (one request that grants and commits,
        # as PostgreSQL's grants are), the retry's answer on a new connection: refused for want of the room
        # its own grant took, it reads the lease under its key instead.
        held = bench.client.acquire(bench.wants, key=f"{ns}replayed", timeout=5)
        proxy.cut_all()
        bytes0, packets0 = proxy.server_bytes, proxy.client_packets
        assert bench.client.acquire(bench.wants, key=f"{ns}replayed", timeout=5).tokens == held.tokens
        span = max(span, proxy.server_bytes - bytes0)
        requests = max(requests, proxy.client_packets - packets0)
        assert bench.client.release(held) == ReleaseOutcome.RELEASED
        gave_up: dict[str, bool] = {}
        # Every sixteenth of the exchange (and past its end) with PERMITS_THOROUGH, else every eighth; the
        # packet cuts below still cut after every request either way.
        parts = 16 if THOROUGH else 8
        for n in sorted({0, 1, 5, 20} | {span * i // parts for i in range(1, parts + 3)}):
            key = f"{ns}every-bytes{n}"
            before = bench.last_tokens()
            proxy.cut_after_server_bytes(n, every=True)
            lease, gave_up[key] = bench.acquire_through_cuts(key)
            bench.assert_granted_once(key, lease, before, f"every connection cut after {n} server bytes")
        for m in range(1, requests + 2):
            key = f"{ns}every-packets{m}"
            before = bench.last_tokens()
            proxy.cut_after_client_packets(m, every=True)
            lease, gave_up[key] = bench.acquire_through_cuts(key)
            bench.assert_granted_once(key, lease, before, f"every connection cut after client packet {m}")
        assert any(gave_up.values()), "the store never gave up: the cuts did not reach it"
        assert not all(gave_up.values()), "the store gave up even where a new connection could finish"
    finally:
        bench.close()


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cut_anywhere_in_one_release(db_url: str, proxy: CuttingProxy, ns: str, shape: str) -> None:
    """A release whose connection drops, at any byte of its reply or after any of its requests, and which is
    retried (by the store, or by the caller after StorageUnavailable), gives the permits back exactly once."""
    bench = _Bench(db_url, proxy, ns, shape, "tight")
    direct = bench.direct
    try:
        sizes: list[tuple[int, int]] = []
        for i in range(8):
            lease = bench.client.acquire(bench.wants, key=f"{ns}probe{i}", timeout=5)
            bytes0, packets0 = proxy.server_bytes, proxy.client_packets
            assert bench.client.release(lease) == ReleaseOutcome.RELEASED
            sizes.append((proxy.server_bytes - bytes0, proxy.client_packets - packets0))
        size, packets = min(s for s, _ in sizes), min(p for _, p in sizes)
        assert size > 0 and packets > 0

        cuts = [("bytes", n) for n in range(size)] + [("packets", m) for m in range(1, packets + 1)]
        for kind, n in cuts:
            key = f"{ns}{kind}{n}"
            where = f"release cut after {n} server bytes" if kind == "bytes" else f"release cut after packet {n}"
            bench.client.acquire(bench.wants, key=key, timeout=5)
            fired = proxy.cuts
            outcome = bench.through_cut(kind, n, functools.partial(bench.client.release, key))
            try:
                assert kind == "packets" or proxy.cuts == fired + 1, "no cut"
                # The reply to the release that did it may be the one that was lost.
                assert outcome in (ReleaseOutcome.RELEASED, ReleaseOutcome.ALREADY_RELEASED)
                assert direct.get_lease(key).end_reason == permits.EndReason.RELEASED
                for name in bench.names:
                    assert direct.get_semaphore(name).used == 0
                    assert direct.holders(name) == []
                assert direct.reconcile() == []
                assert bench.client.release(key) == ReleaseOutcome.ALREADY_RELEASED
            except AssertionError as exc:
                raise AssertionError(f"{where}: {exc}") from exc
    finally:
        bench.close()


@pytest.mark.slow
def test_cut_anywhere_in_a_forced_delete(db_url: str, proxy: CuttingProxy, ns: str) -> None:
    """A forced delete of a semaphore with leases on it runs as two transactions: the leases are revoked and
    committed, then the semaphore goes. Cut at any request, or at any stride of bytes of its replies, and
    retried (by the store, or by the caller after StorageUnavailable), it revokes every lease once, deletes
    the semaphore, and counts the leases it revoked, also when the reply to the first COMMIT was the one
    lost."""
    bench = _Bench(db_url, proxy, ns, "one", "roomy")
    direct, client = bench.direct, bench.client
    holders = 2

    def prepare(name: str) -> list[str]:
        direct.create_semaphore(name, holders + 1)
        keys = [f"{name}-holder{i}" for i in range(holders)]
        for key in keys:
            direct.acquire({name: 1}, key=key, timeout=5)
        return keys

    try:
        sizes: list[tuple[int, int]] = []
        for i in range(3):
            prepare(f"{ns}probe{i}")
            bytes0, packets0 = proxy.server_bytes, proxy.client_packets
            assert client.delete_semaphore(f"{ns}probe{i}", force=True) == holders
            sizes.append((proxy.server_bytes - bytes0, proxy.client_packets - packets0))
        size, packets = min(s for s, _ in sizes), min(p for _, p in sizes)
        assert size > 0 and packets > 1, "a forced delete of a held semaphore takes two transactions"

        cuts = [("packets", m) for m in range(1, packets + 1)] + [("bytes", n) for n in range(0, size, STRIDE * 3)]
        for kind, n in cuts:
            name = f"{ns}{kind}{n}"
            keys = prepare(name)
            if kind == "bytes":
                proxy.cut_after_server_bytes(n)
            else:
                proxy.cut_after_client_packets(n)
            revoked: int | None
            try:
                revoked = client.delete_semaphore(name, force=True)
            except StorageUnavailable:
                proxy.heal()
                try:
                    revoked = client.delete_semaphore(name, force=True)
                except permits.SemaphoreNotFound:
                    revoked = None  # the call that gave up had deleted it; its answer was lost with it
            proxy.heal()
            where = (
                f"forced delete cut after {n} server bytes"
                if kind == "bytes"
                else f"forced delete cut after packet {n}"
            )
            try:
                assert revoked in (holders, None), f"it counted {revoked} revoked leases of {holders}"
                with pytest.raises(permits.SemaphoreNotFound):
                    direct.get_semaphore(name)
                for key in keys:
                    assert direct.get_lease(key).end_reason == permits.EndReason.REVOKED
                assert direct.reconcile() == []
            except AssertionError as exc:
                raise AssertionError(f"{where}: {exc}") from exc
    finally:
        bench.close()


@pytest.mark.slow
def test_cut_anywhere_in_one_turn(db_url: str, proxy: CuttingProxy, ns: str) -> None:
    """A line's turn (the service's group commit, ``HAND_OVER``) that releases a lease and grants the request
    waiting for its permit, cut at any byte of its reply or after any of its requests, and sent again by the
    store: the request is granted in the answer, or left to ask alone (which finds its lease under its key),
    never answered as not granted while its key holds the permit; the release is done, or left to its caller,
    exactly once."""
    bench = _Bench(db_url, proxy, ns, "one", "tight")
    direct, client = bench.direct, bench.client
    store = client._store  # type: ignore[attr-defined]
    assert store.hands_over
    (name,) = bench.names

    def turn(key: str) -> Any:
        held = client.acquire(name, key=f"{key}-held", ttl=30, timeout=5)
        return held, lambda: store.hand_over(name, [(bench.owner, held.key)], [(bench.owner, key, 30_000)], 5.0)

    try:
        sizes: list[tuple[int, int]] = []
        for i in range(8):
            _, run = turn(f"{ns}probe{i}")
            bytes0, packets0 = proxy.server_bytes, proxy.client_packets
            handed = run()
            sizes.append((proxy.server_bytes - bytes0, proxy.client_packets - packets0))
            assert handed.released == [True] and handed.leases[0] is not None
            assert direct.release(f"{ns}probe{i}") == ReleaseOutcome.RELEASED
        size, packets = min(s for s, _ in sizes), min(p for _, p in sizes)
        assert size > 0 and packets > 0

        points = set(range(0, size, STRIDE)) | set(range(min(HEAD, size))) | set(range(max(0, size - TAIL), size))
        cuts = [("bytes", n) for n in sorted(points)] + [("packets", m) for m in range(1, packets + 1)]
        for kind, n in cuts:
            key = f"{ns}{kind}{n}"
            where = f"turn cut after {n} server bytes" if kind == "bytes" else f"turn cut after packet {n}"
            held, run = turn(key)
            before = bench.last_tokens()[name]
            fired = proxy.cuts
            handed = bench.through_cut(kind, n, run)
            try:
                assert kind == "packets" or proxy.cuts == fired + 1, "no cut"
                (lease,) = handed.leases
                if lease is None:
                    # Not granted in the answer: it asks alone, and that finds the lease a lost reply granted.
                    assert handed.ask_alone, handed
                    lease = client.acquire(name, key=key, ttl=30, timeout=0)
                assert lease.tokens[name] == before + 1
                assert direct.get_lease(key).tokens == lease.tokens
                if not handed.released[0]:  # left to its caller, whose release finds it done
                    assert client.release(held.key) in (ReleaseOutcome.RELEASED, ReleaseOutcome.ALREADY_RELEASED)
                assert direct.get_lease(held.key).end_reason == permits.EndReason.RELEASED
                assert direct.get_semaphore(name).used == 1
                assert direct.reconcile() == []
            except AssertionError as exc:
                raise AssertionError(f"{where}: {exc}") from exc
            assert direct.release(key) == ReleaseOutcome.RELEASED
    finally:
        bench.close()


# ---- a link that stalls without failing

#: the tests' reply_timeout, beside lock_wait_timeout=1: an answer is overdue after 3 s
REPLY_TIMEOUT = 3.0
#: the bound asserted: the overdue answer (3 s, and up to half a second more for the sync store's watch), one
#: new connection that the stalled link never answers (PostgreSQL's connect_timeout, 5 s; MariaDB's bound on
#: its handshake, 3 s), a backoff, and slack for a loaded machine
BOUND = 15.0


@pytest.fixture
def stalling_client(db_url: str, proxy: CuttingProxy, flavour: str) -> Iterator[Any]:
    url = proxy.url_for(db_url)
    options: dict[str, Any] = {"owner": "stalled", "lock_wait_timeout": 1, "retries": 1, "reply_timeout": REPLY_TIMEOUT}
    client: Any
    if flavour == "sync":
        client = permits.connect(url, **options)
    else:
        client = AsyncFacade(permits.connect_async(url, **options))
    yield client
    proxy.resume()
    client.shutdown() if isinstance(client, AsyncFacade) else client.close()


@pytest.mark.slow
def test_an_acquire_over_a_stalled_link_fails_in_bounded_time_and_its_retry_is_granted_once(
    db_url: str, proxy: CuttingProxy, stalling_client: Any, ns: str
) -> None:
    """Before the bound, the acquire below waited until TCP gave up (over 2 minutes, measured)."""
    name, key = f"{ns}stalled", f"{ns}key"
    with permits.connect(db_url, owner="stalled") as direct:
        direct.create_semaphore(name, 1)
        stalling_client.release(stalling_client.acquire(name, ttl=30))  # a pooled connection is open
        proxy.stall()
        began = time.monotonic()
        with pytest.raises(StorageUnavailable):
            stalling_client.acquire(name, key=key, ttl=30, timeout=1)
        took = time.monotonic() - began
        assert took < BOUND, f"the acquire took {took:.1f} s over a stalled link"
        # The stalled grant may run once the link is back; asking again with the same key answers from it, or
        # grants anew: once, either way.
        proxy.resume()
        lease = stalling_client.acquire(name, key=key, ttl=30, timeout=10)
        assert lease.held and direct.get_lease(key).tokens == lease.tokens
        assert direct.get_semaphore(name).used == 1
        assert direct.reconcile() == []
        assert direct.release(key) == ReleaseOutcome.RELEASED


@pytest.mark.slow
def test_a_release_over_a_stalled_link_fails_in_bounded_time_and_its_retry_releases_once(
    db_url: str, proxy: CuttingProxy, stalling_client: Any, ns: str
) -> None:
    name = f"{ns}stalled"
    with permits.connect(db_url, owner="stalled") as direct:
        direct.create_semaphore(name, 1)
        lease = stalling_client.acquire(name, ttl=30)
        proxy.stall()
        began = time.monotonic()
        with pytest.raises(StorageUnavailable):
            stalling_client.release(lease)
        took = time.monotonic() - began
        assert took < BOUND, f"the release took {took:.1f} s over a stalled link"
        proxy.resume()
        assert stalling_client.release(lease) in (ReleaseOutcome.RELEASED, ReleaseOutcome.ALREADY_RELEASED)
        assert direct.get_semaphore(name).used == 0
        assert direct.reconcile() == []


@pytest.mark.slow
def test_a_grant_held_on_a_stalled_link_is_ended_before_its_retry_and_never_runs_later(
    db_url: str, proxy: CuttingProxy, stalling_client: Any, ns: str
) -> None:
    """A partial failure: the link the pooled connection uses hangs (one path through a load balancer, say)
    while new connections work. The try's grant is held on the hung link; the store gives up on it, and its
    retry on a new connection finds no room, so the caller hears "no room" and goes away. Then the holder
    releases and the hung link delivers what it held. Had the grant's server session lived on, the grant
    would run then and take a permit under a key nobody holds, for its whole TTL; the store ends that
    session before the retry, so the held request reaches a closed connection. (Measured before the fix:
    the semaphore held that permit after the link came back.)"""
    name, key = f"{ns}late", f"{ns}key"
    with permits.connect(db_url, owner="stalled") as direct:
        direct.create_semaphore(name, 1)
        # A pooled connection is open, and on PostgreSQL has the grant prepared: the stalled request is then
        # the whole grant, not only its Parse (psycopg waits for the Parse's reply before it sends the rest).
        for warm in range(2):
            stalling_client.release(stalling_client.try_acquire(name, key=f"{ns}warm{warm}", ttl=30))
        holder = direct.acquire(name, key=f"{ns}holder", ttl=30)
        proxy.stall(new_too=False)
        began = time.monotonic()
        assert stalling_client.try_acquire(name, key=key, ttl=30) is None
        assert time.monotonic() - began < BOUND
        assert direct.release(holder) == ReleaseOutcome.RELEASED
        proxy.resume()
        # Whatever the hung link held is delivered at once; a grant that ran would show within a moment.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert direct.get_semaphore(name).used == 0, "the held grant ran after its caller had gone"
            time.sleep(0.1)
        with pytest.raises(permits.LeaseNotFound):
            direct.get_lease(key, owner="stalled")
        assert direct.reconcile() == []


@pytest.mark.slow
def test_a_new_connection_whose_link_stalls_after_the_handshake_fails_in_bounded_time(
    db_url: str, proxy: CuttingProxy, stalling_client: Any, ns: str
) -> None:
    """A new connection's own statements (its server session noted, and on PostgreSQL its session settings)
    run before any operation's: the link stalls just as the first of them goes out. The connect then fails
    in bounded time, as an operation's statement would, and the call raises ``StorageUnavailable``.
    (Measured before the fix: the call was still waiting after 60 s.)"""
    name = f"{ns}setup"
    with permits.connect(db_url, owner="stalled") as direct:
        direct.create_semaphore(name, 1)
        stalling_client.release(stalling_client.acquire(name, ttl=30))  # open, with a pooled connection
        proxy.stall_on(_first_line(stalling_client, "SESSION_OF"))
        proxy.cut_all()  # the pooled connection goes: the next call needs a new one
        began = time.monotonic()
        with pytest.raises(StorageUnavailable):
            stalling_client.acquire(name, key=f"{ns}key", ttl=30, timeout=1)
        took = time.monotonic() - began
        assert took < BOUND, f"the acquire took {took:.1f} s over a link that stalled after the handshake"
        proxy.resume()
        lease = stalling_client.acquire(name, key=f"{ns}key", ttl=30, timeout=10)
        assert direct.get_semaphore(name).used == 1
        assert stalling_client.release(lease) == ReleaseOutcome.RELEASED


def _first_line(client: Any, statement: str) -> bytes:
    """The first line of one of the client's named statements, as the driver sends it."""
    store = client._client._store if isinstance(client, AsyncFacade) else client._store
    return str(store._dialect.sql(statement)).strip().splitlines()[0].strip().encode()


@pytest.mark.slow
def test_a_client_whose_link_stalls_as_it_opens_fails_in_bounded_time(
    proxy: CuttingProxy, stalling_client: Any
) -> None:
    """The first call opens the client: it reads the schema's revision before anything else. A link that
    stalls there fails the call in bounded time, and once it is back the client opens and works.
    (Measured before the fix: the call was still waiting after 60 s.)"""
    proxy.stall_on(VERSION_TABLE.encode())
    began = time.monotonic()
    with pytest.raises(StorageUnavailable):
        stalling_client.list_semaphores()
    took = time.monotonic() - began
    assert took < BOUND, f"opening took {took:.1f} s over a link that stalled"
    proxy.resume()
    assert isinstance(stalling_client.list_semaphores(), list)


@pytest.mark.slow
def test_the_service_ends_the_sessions_of_the_links_it_cuts_and_counts_them(
    db_url: str, proxy: CuttingProxy, ns: str
) -> None:
    """A real ``permits serve`` whose database links hang while new ones work: its answer still comes, the
    cut connection's session is ended, and /metrics says so (docs/service.md)."""
    env = {
        "PERMITS_LOCK_WAIT_TIMEOUT": "1",
        "PERMITS_REPLY_TIMEOUT": str(REPLY_TIMEOUT),
        "PERMITS_DB_POOL_SIZE": "1",
        "PERMITS_MAINTENANCE__ENABLED": "false",
    }
    name = f"{ns}served"
    with running(proxy.url_for(db_url), env=env) as service, permits.connect(service.url) as client:
        client.create_semaphore(name, 1)
        client.release(client.acquire(name, ttl=30))
        proxy.stall(new_too=False)
        lease = client.acquire(name, key=f"{ns}key", ttl=30, timeout=60)
        assert lease.held
        proxy.resume()
        wait_until(lambda: (_metric(service, "cut") or 0) >= 1 and (_metric(service, "ended") or 0) >= 1)
        assert client.release(lease) == ReleaseOutcome.RELEASED


def _metric(service: Any, event: str) -> float | None:
    wanted = f'permits_store_reply_cuts_total{{event="{event}"}} '
    for line in httpx.get(f"{service.url}/metrics").text.splitlines():
        if line.startswith(wanted):
            return float(line.split()[1])
    return None
