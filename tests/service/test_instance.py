"""Inside one service instance: the pre-lock and the maintenance tasks, on every backend.

These drive ``ServiceState`` (what ``permits serve`` runs) directly on an event loop, with real databases,
so they can look at what reaches the database and run two instances' maintenance side by side.
"""

from __future__ import annotations

import asyncio
import http.server
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import permits
from permits import EndReason
from permits._core import observe
from permits._core.flows import Flow, HandedOver
from permits.server.config import Dashboard, LivenessCheck, Maintenance, ServerConfig
from permits.server.maintenance import Maintainer, Task
from permits.server.state import ServiceState


def _state(db_url: str, **config: Any) -> ServiceState:
    return ServiceState.build(ServerConfig(database_url=db_url, **config))


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


# ------------------------------------------------------------------------------------------- pre-lock


@pytest.mark.parametrize("prelock", [True, False])
def test_prelock_sends_one_attempt_per_semaphore_at_a_time(db_url: str, ns: str, prelock: bool) -> None:
    async def scenario() -> tuple[int, int]:
        state = _state(db_url, prelock=prelock)
        inner = state.sql_store
        attempt = inner.try_acquire
        in_flight = peak = 0

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await asyncio.sleep(0.01)  # hold the attempt open long enough for others to pile up
                return await attempt(*args, **kwargs)
            finally:
                in_flight -= 1

        inner.try_acquire = counted  # type: ignore[method-assign]
        async with state.client as client:
            await client.create_semaphore(f"{ns}hot", 5)
            leases = await asyncio.gather(*(client.try_acquire(f"{ns}hot", ttl=30) for _ in range(12)))
            for lease in leases:
                if lease is not None:
                    await client.release(lease)
            assert (await client.get_semaphore(f"{ns}hot")).used == 0
            assert await client.reconcile() == []
        return peak, sum(lease is not None for lease in leases)

    peak, granted = _run(scenario())
    assert granted == 5  # capacity holds either way
    if prelock:
        assert peak == 1  # the rest queued in memory, not on database connections
    else:
        assert peak > 1


def test_prelock_queue_wait_is_bounded(db_url: str, ns: str) -> None:
    async def scenario() -> None:
        state = _state(db_url, prelock_wait=0.2)
        attempt = state.sql_store.try_acquire

        async def slow(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(1.0)  # a database that answers slowly
            return await attempt(*args, **kwargs)

        state.sql_store.try_acquire = slow  # type: ignore[method-assign]
        async with state.client as client:
            await client.create_semaphore(f"{ns}s", 5)
            results = await asyncio.gather(
                *(client.try_acquire(f"{ns}s", ttl=30) for _ in range(3)), return_exceptions=True
            )
            assert sum(isinstance(r, permits.Lease) for r in results) == 1
            queued_too_long = [r for r in results if isinstance(r, permits.ServiceUnavailable)]
            assert len(queued_too_long) == 2 and all(r.retryable for r in queued_too_long)

    _run(scenario())


def test_a_release_wakes_a_waiter_at_once(db_url: str, ns: str, slow_polling: None) -> None:
    async def scenario() -> float:
        state = _state(db_url)
        async with state.client as client:
            await client.create_semaphore(f"{ns}s", 1)
            held = await client.acquire(f"{ns}s", ttl=30)
            # The waiter polls every 10 s or more (slow_polling): only the release can wake it in time.
            waiter = asyncio.create_task(client.acquire(f"{ns}s", ttl=30, timeout=20))
            await asyncio.sleep(2.5)
            released_at = asyncio.get_running_loop().time()
            await client.release(held)
            lease = await waiter
            woke_after = asyncio.get_running_loop().time() - released_at
            await client.release(lease)
            return woke_after

    assert _run(scenario()) < 1.5


# ------------------------------------------------------------------------------------------- hand-off


def test_waiters_in_one_instance_are_served_in_arrival_order(db_url: str, ns: str) -> None:
    async def scenario() -> tuple[list[int], list[float], int]:
        state = _state(db_url)
        attempt = state.sql_store.try_acquire
        attempts = 0

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal attempts
            attempts += 1
            return await attempt(*args, **kwargs)

        state.sql_store.try_acquire = counted  # type: ignore[method-assign]
        async with state.client as client:
            await client.create_semaphore(f"{ns}m", 1)
            held = await client.acquire(f"{ns}m", ttl=30)
            granted: list[int] = []
            leases: dict[int, permits.Lease] = {}

            async def waiter(i: int) -> None:
                leases[i] = await client.acquire(f"{ns}m", ttl=30, timeout=30)
                granted.append(i)

            tasks = []
            for i in range(5):
                tasks.append(asyncio.create_task(waiter(i)))
                await asyncio.sleep(0.05)  # a clear arrival order
            await asyncio.sleep(0.3)
            assert state.instance_store.handoff is not None
            assert state.instance_store.handoff.queued(f"{ns}m") == 5
            hand_offs: list[float] = []
            before = attempts
            current = held
            for i in range(5):
                released_at = asyncio.get_running_loop().time()
                await client.release(current)
                while len(granted) <= i:
                    await asyncio.sleep(0.001)
                hand_offs.append(asyncio.get_running_loop().time() - released_at)
                current = leases[granted[-1]]
            await client.release(current)
            await asyncio.gather(*tasks)
            assert (await client.get_semaphore(f"{ns}m")).used == 0
            return granted, hand_offs, attempts - before

    granted, hand_offs, attempts = _run(scenario())
    assert granted == [0, 1, 2, 3, 4]  # first come, first served
    assert max(hand_offs) < 0.3, hand_offs  # a release here reaches the head of the line at once
    # About one attempt per hand-off, not one per waiter (that would be 5 + 4 + 3 + 2 + 1 = 15 and more). On
    # PostgreSQL the NOTIFY of a release handed off here may add one more, and a poll one now and then.
    assert attempts <= 2 * 5 + 2, attempts


def test_a_retry_of_a_granted_key_does_not_wait_behind_the_line(db_url: str, ns: str) -> None:
    async def scenario() -> None:
        state = _state(db_url)
        async with state.client as client:
            await client.create_semaphore(f"{ns}m", 1)
            held = await client.acquire(f"{ns}m", key="mine", ttl=30)
            waiter = asyncio.create_task(client.acquire(f"{ns}m", key="other", ttl=30, timeout=20))
            await asyncio.sleep(0.3)
            assert state.instance_store.handoff is not None
            assert state.instance_store.handoff.queued(f"{ns}m") == 1
            # The same key again (a reply lost on the way, say), while a line waits for the permit it holds.
            started = asyncio.get_running_loop().time()
            again = await client.acquire(f"{ns}m", key="mine", ttl=30, timeout=10)
            assert asyncio.get_running_loop().time() - started < 1.0
            assert again.token == held.token
            await client.release(held)
            await client.release(await waiter)

    _run(scenario())


def test_in_the_line_a_new_only_request_shares_its_place_only_with_its_own_retries(db_url: str, ns: str) -> None:
    """Under one key, a retry of a ``new_only`` request (the same request id) takes that request's place and
    answer; another ``new_only`` request (another id) and a plain request under the key each wait in a place
    of their own, since their answers differ: ``KeyInUse`` for the one, the key's lease for the other."""

    async def scenario() -> None:
        state = _state(db_url)
        async with state.client as client:
            name = f"{ns}m"
            await client.create_semaphore(name, 1)
            held = await client.acquire(name, key="holder", ttl=30)
            handoff = state.instance_store.handoff
            assert handoff is not None

            async def in_line(queued: int, **options: Any) -> asyncio.Task[permits.Lease]:
                task = asyncio.create_task(client.acquire(name, key="k", ttl=30, timeout=20, **options))
                for _ in range(200):
                    await asyncio.sleep(0.01)
                    if handoff.queued(name) == queued:
                        break
                await asyncio.sleep(0.1)  # and no more places than that
                assert handoff.queued(name) == queued
                return task

            first = await in_line(1, new_only=True, request_id="r-1")
            retry = await in_line(1, new_only=True, request_id="r-1")
            other = await in_line(2, new_only=True, request_id="r-2")
            plain = await in_line(3)
            await client.release(held)
            lease = await first
            assert (await retry).token == lease.token
            with pytest.raises(permits.KeyInUse):
                await other
            assert (await plain).token == lease.token
            assert await client.release(lease) is permits.ReleaseOutcome.RELEASED
            assert (await client.get_semaphore(name)).used == 0

    _run(scenario())


def test_a_waiter_in_line_leaves_it_at_its_deadline(db_url: str, ns: str) -> None:
    async def scenario() -> None:
        state = _state(db_url)
        async with state.client as client:
            await client.create_semaphore(f"{ns}m", 1)
            held = await client.acquire(f"{ns}m", ttl=30)
            started = asyncio.get_running_loop().time()
            with pytest.raises(permits.AcquireTimeout):
                await client.acquire(f"{ns}m", key="late", ttl=30, timeout=0.3)
            assert asyncio.get_running_loop().time() - started < 2
            assert state.instance_store.handoff is not None
            await asyncio.sleep(0.2)
            assert state.instance_store.handoff.queued(f"{ns}m") == 0
            assert state.waker.waiters == 0
            await client.release(held)
            await asyncio.sleep(0.3)
            # Nothing was granted to the request that gave up.
            assert (await client.get_semaphore(f"{ns}m")).used == 0
            with pytest.raises(permits.LeaseNotFound):
                await client.get_lease("late")

    _run(scenario())


def test_a_line_finds_room_made_through_another_instance(db_url: str, ns: str) -> None:
    async def scenario() -> float:
        first, second = _state(db_url), _state(db_url)
        async with first.client as a, second.client as b:
            await a.create_semaphore(f"{ns}m", 1)
            held = await a.acquire(f"{ns}m", ttl=30)
            waiter = asyncio.create_task(b.acquire(f"{ns}m", ttl=30, timeout=20))
            await asyncio.sleep(1.0)
            released_at = asyncio.get_running_loop().time()
            await a.release(held)
            lease = await waiter
            found_after = asyncio.get_running_loop().time() - released_at
            await b.release(lease)
            return found_after

    # The line's poll is capped at 0.1 s (PostgreSQL's NOTIFY is heard sooner).
    assert _run(scenario()) < 1.0


def test_shutdown_answers_the_waiters_in_line(db_url: str, ns: str) -> None:
    async def scenario() -> None:
        state = _state(db_url)
        async with state.client as client:
            await client.create_semaphore(f"{ns}m", 1)
            await client.acquire(f"{ns}m", ttl=30)
            waiters = [asyncio.create_task(client.acquire(f"{ns}m", ttl=30, timeout=20)) for _ in range(3)]
            await asyncio.sleep(0.3)
            state.waker.draining.set()
            done, pending = await asyncio.wait(waiters, timeout=2)
            assert not pending
            for task in done:
                assert isinstance(task.exception(), permits.ServiceUnavailable)

    _run(scenario())


# ------------------------------------------------------------------------------------ turns (group commit)

#: The servers whose stores work in turns (HAND_OVER); on SQLite the lines ask one request at a time.
turns = pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)


def _count_turns(state: ServiceState) -> list[tuple[int, int, int]]:
    """Record each turn the instance's store runs: (releases, requests, granted)."""
    store: Any = state.sql_store
    hand_over = store.hand_over
    seen: list[tuple[int, int, int]] = []

    async def counted(name: str, gone: Any, requests: Any, wait: Any = None) -> Any:
        handed = await hand_over(name, gone, requests, wait)
        seen.append((len(gone), len(requests), sum(lease is not None for lease in handed.leases)))
        return handed

    store.hand_over = counted
    return seen


@turns
def test_a_turn_hands_the_permits_released_here_to_the_line_in_order(db_url: str, ns: str) -> None:
    async def scenario() -> None:
        state = _state(db_url)
        seen = _count_turns(state)
        async with state.client as client:
            name = f"{ns}hot"
            await client.create_semaphore(name, 3)
            held = [await client.acquire(name, ttl=30) for _ in range(3)]
            leases: dict[int, permits.Lease] = {}

            async def waiter(i: int) -> None:
                leases[i] = await client.acquire(name, ttl=30, timeout=20)

            tasks = []
            for i in range(6):
                tasks.append(asyncio.create_task(waiter(i)))
                await asyncio.sleep(0.02)  # a clear arrival order
            await asyncio.sleep(0.2)
            assert state.instance_store.handoff is not None and state.instance_store.handoff.turns
            assert state.instance_store.handoff.queued(name) == 6
            seen.clear()
            await asyncio.gather(*(client.release(lease) for lease in held))
            for _ in range(200):
                if len(leases) == 3:
                    break
                await asyncio.sleep(0.01)
            # The first three to come, and no more: the room the releases made.
            assert sorted(leases) == [0, 1, 2]
            tokens = [leases[i].token for i in range(3)]
            assert tokens == sorted(tokens) and tokens[0] > max(lease.token for lease in held)
            # Released and handed over together, in few statements (one per turn, not one per release and
            # one per grant).
            assert sum(granted for _, _, granted in seen) == 3, seen
            assert any(gone and granted for gone, _, granted in seen), seen
            assert len(seen) <= 3, seen
            for i in range(3):
                await client.release(leases[i])
            await asyncio.gather(*tasks)
            for i in range(3, 6):
                await client.release(leases[i])
            assert (await client.get_semaphore(name)).used == 0
            assert await client.reconcile() == []

    _run(scenario())


@turns
def test_shutdown_answers_a_request_a_turn_may_have_granted_as_unknown(db_url: str, ns: str) -> None:
    """A turn that cannot say why it granted nothing (its commit's reply lost, say) leaves its requests to
    ask alone: any of them may hold a lease under its key. If the instance drains then, those are answered
    503 ``storage_unavailable`` (the outcome is unknown: a retry under the same key gets the lease), not
    ``service_unavailable``, which says the request was not carried out."""

    async def scenario() -> list[BaseException | None]:
        state = _state(db_url)
        store: Any = state.sql_store

        async def unseen(name: str, gone: Any, requests: Any, wait: Any = None) -> HandedOver:
            state.waker.draining.set()  # the instance is stopped as the turn's outcome is lost
            return HandedOver([False] * len(gone), [None] * len(requests), ask_alone=True)

        async with state.client as client:
            name = f"{ns}hot"
            await client.create_semaphore(name, 1)
            held = await client.acquire(name, ttl=30)
            waiters = [asyncio.create_task(client.acquire(name, ttl=30, timeout=20)) for _ in range(3)]
            await asyncio.sleep(0.3)
            assert state.instance_store.handoff is not None and state.instance_store.handoff.queued(name) == 3
            store.hand_over = unseen
            await client.release(held)
            done, pending = await asyncio.wait(waiters, timeout=5)
            assert not pending
            return [task.exception() for task in done]

    answers = _run(scenario())
    assert answers and all(isinstance(answer, permits.StorageUnavailable) for answer in answers), answers


@turns
def test_a_turn_with_a_key_granted_elsewhere_answers_it_from_its_lease(db_url: str, ns: str) -> None:
    """A request whose key has a lease already (granted through another instance, its reply lost) goes to
    the line like any other: its turn does nothing, and asked alone, it is answered from its lease, and the
    request beside it granted."""

    async def scenario() -> None:
        state = _state(db_url)
        seen = _count_turns(state)
        name = f"{ns}s"
        async with state.client as client, permits.connect_async(db_url, owner=f"{ns}x") as elsewhere:
            await client.create_semaphore(name, 2)
            earlier = await elsewhere.acquire(name, key=f"{ns}k", ttl=30)
            mine = await client.acquire(name, ttl=30)
            first = asyncio.create_task(client.acquire(name, owner=f"{ns}y", ttl=30, timeout=20))
            await asyncio.sleep(0.1)
            retry = asyncio.create_task(client.acquire(name, owner=f"{ns}x", key=f"{ns}k", ttl=30, timeout=20))
            await asyncio.sleep(0.2)
            await client.release(mine)
            again = await asyncio.wait_for(retry, 5)
            assert again.token == earlier.token and again.key == earlier.key
            granted = await asyncio.wait_for(first, 5)
            assert granted.token > earlier.token
            assert any(requests == 2 and not got for _, requests, got in seen), seen  # the turn that did nothing
            await client.release(granted)
            await elsewhere.release(earlier)
            assert await client.reconcile() == []

    _run(scenario())


@turns
def test_a_retry_behind_the_line_of_a_key_granted_elsewhere_is_answered_from_its_lease(db_url: str, ns: str) -> None:
    """A request whose key has a lease already (granted through another instance, its reply lost), which
    fills the semaphore: retried here, it joins the line behind a waiter, and no turn can grant it or see
    its lease. At its deadline it is not answered "no room" before it asks once with its full recheck,
    which answers it from its lease."""

    async def scenario() -> None:
        state = _state(db_url)
        name = f"{ns}s"
        async with state.client as client, permits.connect_async(db_url, owner=f"{ns}x") as elsewhere:
            await client.create_semaphore(name, 1)
            earlier = await elsewhere.acquire(name, key=f"{ns}k", ttl=30)
            ahead = asyncio.create_task(client.acquire(name, owner=f"{ns}y", ttl=30, timeout=3))
            await asyncio.sleep(0.2)
            assert state.instance_store.handoff is not None
            assert state.instance_store.handoff.queued(name) == 1
            again = await client.acquire(name, owner=f"{ns}x", key=f"{ns}k", ttl=30, timeout=0.5)
            assert (again.key, again.token) == (earlier.key, earlier.token)
            await elsewhere.release(earlier)
            granted = await asyncio.wait_for(ahead, 5)
            await client.release(granted)
            assert await client.reconcile() == []

    _run(scenario())


@turns
@pytest.mark.parametrize("resent", ["no-room", "conflict"])
def test_a_turn_whose_reply_was_lost_past_the_deadline_answers_from_the_lease(
    db_url: str, ns: str, resent: str
) -> None:
    """A turn commits a grant and its reply is lost (a cut link): the store sends the turn again, which
    finds no room (the lost reply's grant took it), or meets a lock conflict it may not retry, and, by then,
    the request's deadline past. The request is not answered "no room" (nor with the conflict, which its
    caller takes for the same), which would leave its permit held by nobody until its TTL: it asks alone,
    with its full recheck, and is answered from the lease the lost reply granted."""

    async def scenario() -> None:
        state = _state(db_url)
        store: Any = state.sql_store
        run = store._run
        lost: list[Any] = []

        async def reply_lost_once(make_flow: Any, *args: Any, **kwargs: Any) -> Any:
            done = await run(make_flow, *args, **kwargs)
            if lost or not isinstance(done, HandedOver) or not any(done.leases):
                return done
            lost.append(done)  # committed, and its reply lost: sent again (as _run does), past the deadline
            await asyncio.sleep(0.8)
            if resent == "conflict":
                make_flow()  # the second try's statement, refused: a lock wait timed out
                raise permits.StorageConflict("lock wait timeout exceeded (the test's)")
            return await run(make_flow, *args, **kwargs)

        store._run = reply_lost_once
        name = f"{ns}s"
        async with state.client as client:
            await client.create_semaphore(name, 1)
            held = await client.acquire(name, ttl=30)
            waiters = [
                asyncio.create_task(client.acquire(name, owner=f"{ns}w{i}", key=f"{ns}k{i}", ttl=30, timeout=0.5))
                for i in range(2)
            ]
            await asyncio.sleep(0.1)
            await client.release(held)
            answers = await asyncio.gather(*waiters, return_exceptions=True)
            assert lost, "no turn granted anything"
            (granted,) = [lease for lease in lost[0].leases if lease is not None]
            assert [(a.key, a.token) for a in answers if isinstance(a, permits.Lease)] == [
                (granted.key, granted.token)
            ], answers
            assert all(isinstance(a, (permits.Lease, permits.AcquireTimeout)) for a in answers), answers
            await client.release(granted)
            assert (await client.get_semaphore(name)).used == 0
            assert await client.reconcile() == []

    _run(scenario())


def test_a_waiter_with_a_place_in_a_fair_queue_asks_while_the_line_holds_others(
    db_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that holds a place in a fair semaphore's queue asks for itself, as the database orders it,
    even while this instance's line for that semaphore holds requests (new ones, on their way to their own
    places, keep it from emptying under load). It must not be left unasked behind the line: at the head of
    the queue, with room, it would hold up everyone behind it until its place lapsed."""

    async def scenario() -> None:
        state = _state(db_url)
        handoff = state.instance_store.handoff
        assert handoff is not None
        queued = handoff.queued
        monkeypatch.setattr(handoff, "queued", lambda name: max(1, queued(name)))  # arrivals, always
        name = f"{ns}f"
        async with state.client as client:
            await client.create_semaphore(name, 1, fair=True)
            held = await client.acquire(name, ttl=30)
            waiting = asyncio.create_task(client.acquire(name, owner=f"{ns}w", ttl=30, timeout=3))
            await asyncio.sleep(0.3)
            assert [w.owner for w in await client.waiters(name)] == [f"{ns}w"]
            await client.release(held)
            # At once (a few ms): left unasked, it was granted only when its place came up for renewal, seconds
            # later.
            lease = await asyncio.wait_for(waiting, 1.0)
            await client.release(lease)
            assert await client.reconcile() == []

    _run(scenario())


@turns
def test_the_instance_keeps_its_connections_open(db_url: str, ns: str) -> None:
    """Many requests at once on several semaphores use the pool's connections, and open no new ones once it
    has them: SQLAlchemy's default pool keeps 5, and past them every checkout opened a connection anew."""

    async def scenario() -> None:
        state = _state(db_url, db_pool_size=8)
        store: Any = state.sql_store
        connects = 0

        def counted(*_: Any) -> None:
            nonlocal connects
            connects += 1

        from sqlalchemy import event

        event.listen(store._engine.sync_engine, "connect", counted)
        async with state.client as client:
            names = [f"{ns}s{i}" for i in range(6)]
            for name in names:
                await client.create_semaphore(name, 4)

            async def cycles(name: str) -> None:
                for _ in range(5):
                    lease = await client.acquire(name, ttl=30, timeout=10)
                    await client.release(lease)

            await asyncio.gather(*(cycles(name) for name in names for _ in range(3)))
            opened = connects
            await asyncio.gather(*(cycles(name) for name in names for _ in range(3)))
            assert connects == opened, (opened, connects)
            assert opened <= 8 + 1  # the pool's, and the listener's on PostgreSQL
            assert store._engine.sync_engine.pool.size() == 8

    _run(scenario())


# ---------------------------------------------------------------------------------------- maintenance


def test_two_instances_never_run_a_task_at_once(db_url: str, ns: str) -> None:
    async def scenario() -> list[str]:
        first, second = _state(db_url), _state(db_url)
        async with first.client, second.client:
            outcomes = []
            for state in (first, second):
                maintainer = Maintainer(state)
                sweep = maintainer.sweep

                async def slow_sweep(sweep: Any = sweep) -> dict[str, Any]:
                    await asyncio.sleep(0.5)  # still running when the other instance asks
                    return dict(await sweep())

                task = next(t for t in maintainer.tasks() if t.name == "sweep")
                outcomes.append(maintainer.run_once(Task(task.name, task.interval, slow_sweep)))
            return list(await asyncio.gather(*outcomes))

    assert sorted(_run(scenario())) == ["done", "skipped"]


def test_sweep_task_reclaims_expired_leases(db_url: str, ns: str) -> None:
    async def scenario() -> None:
        state = _state(db_url)
        async with state.client as client:
            await client.create_semaphore(f"{ns}s", 3)
            short = await client.acquire(f"{ns}s", ttl=0.1, owner=f"{ns}w")
            await asyncio.sleep(0.3)
            maintainer = Maintainer(state)
            assert await maintainer.run_once(next(t for t in maintainer.tasks() if t.name == "sweep")) == "done"
            assert (await client.get_lease(short.key, owner=f"{ns}w")).end_reason == EndReason.SWEPT

    _run(scenario())


def test_a_sweep_run_ends_within_its_share_of_the_lease_and_says_it_left_some(
    db_url: str, ns: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A run of the sweep starts no batch after its share of the task's lease (SWEEP_RUN_SHARE, half: the
    lease outlives it, and no other instance sweeps beside it); its first batch always runs. A run that
    left some says so (``complete: False`` in its log), and the next runs go on. With the share at 0, each
    run ends one batch of one lease. By default a run is given 15 s: half of its lease's 30 s."""
    given: list[float | None] = []

    async def default_timeout() -> None:
        state = _state(db_url)
        async with state.client as client:
            sweep = client.sweep

            async def noted(**options: Any) -> Any:
                given.append(options.get("timeout"))
                return await sweep(**options)

            client.sweep = noted  # type: ignore[method-assign]
            await Maintainer(state).sweep()

    _run(default_timeout())
    assert given == [15.0], given
    monkeypatch.setattr("permits.server.maintenance.SWEEP_RUN_SHARE", 0.0)

    async def scenario() -> list[dict[str, Any]]:
        state = _state(db_url, maintenance=Maintenance(sweep_batch=1))
        async with state.client as client:
            await client.create_semaphore(f"{ns}s", 5)
            short = [await client.acquire(f"{ns}s", ttl=0.1, owner=f"{ns}w") for _ in range(3)]
            await asyncio.sleep(0.3)
            maintainer = Maintainer(state)
            with caplog.at_level(logging.INFO, logger="permits.maintenance"):
                assert await maintainer.run_once(next(t for t in maintainer.tasks() if t.name == "sweep")) == "done"
            assert "maintenance sweep done, left some for the next run" in caplog.messages, caplog.messages
            runs = [await maintainer.sweep()]
            while "complete" in runs[-1] and len(runs) < 10_000:  # other tests' expired leases too
                runs.append(await maintainer.sweep())
            for lease in short:
                assert (await client.get_lease(lease.key, owner=f"{ns}w")).end_reason == EndReason.SWEPT
            return runs

    runs = _run(scenario())
    assert runs[0] == {"leases": 1, "batches": 1, "complete": False}, runs
    assert len(runs) >= 3 and "complete" not in runs[-1], runs


@pytest.fixture
def liveness_server() -> Iterator[str]:
    """Answers /check/<owner>: 200 for owners containing "alive", 404 for "dead", 500 otherwise."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = 200 if "alive" in self.path else 404 if "dead" in self.path else 500
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/check/{{owner}}"
    server.shutdown()
    server.server_close()


def test_liveness_releases_only_dead_owners(db_url: str, ns: str, liveness_server: str) -> None:
    async def scenario() -> None:
        probe_calls: list[str] = []

        def python_probe(owner: str) -> bool | None:
            probe_calls.append(owner)
            return not owner.endswith("gone")

        config = ServerConfig(
            database_url=db_url,
            maintenance=Maintenance(liveness=[LivenessCheck(prefix=f"{ns}http-", url=liveness_server)]),
        )
        state = ServiceState.build(config, liveness={f"{ns}py-": python_probe})
        async with state.client as client:
            await client.create_semaphore(f"{ns}s", 10)
            owners = [
                f"{ns}http-alive",
                f"{ns}http-dead",
                f"{ns}http-unknown",
                f"{ns}py-here",
                f"{ns}py-gone",
                f"{ns}other",
            ]
            leases = {o: await client.acquire(f"{ns}s", owner=o, ttl=60) for o in owners}
            maintainer = Maintainer(state)
            task = next(t for t in maintainer.tasks() if t.name == "liveness")
            assert await maintainer.run_once(task) == "done"
            ended = {}
            for owner, lease in leases.items():
                now = await client.get_lease(lease.key, owner=owner)
                ended[owner] = now.end_reason
            assert ended == {
                f"{ns}http-alive": None,
                f"{ns}http-dead": EndReason.OWNER_DEAD,
                f"{ns}http-unknown": None,  # no clear answer: release nothing
                f"{ns}py-here": None,
                f"{ns}py-gone": EndReason.OWNER_DEAD,
                f"{ns}other": None,  # no check covers it
            }
            assert sorted(set(probe_calls) & {f"{ns}py-here", f"{ns}py-gone"}) == [f"{ns}py-gone", f"{ns}py-here"]
            assert (await client.get_semaphore(f"{ns}s")).used == 4
            assert await client.reconcile() == []

    _run(scenario())


def test_staleness_releases_leases_held_too_long(db_url: str, ns: str) -> None:
    async def scenario() -> None:
        config = ServerConfig(database_url=db_url, maintenance=Maintenance(max_lease_age=0.5))
        state = ServiceState.build(config)
        async with state.client as client:
            await client.create_semaphore(f"{ns}s", 2)
            old = await client.acquire(f"{ns}s", ttl=600, owner=f"{ns}w")
            await asyncio.sleep(0.8)
            young = await client.acquire(f"{ns}s", ttl=600, owner=f"{ns}w")
            maintainer = Maintainer(state)
            assert await maintainer.run_once(next(t for t in maintainer.tasks() if t.name == "staleness")) == "done"
            stale = await client.get_lease(old.key, owner=f"{ns}w")
            assert stale.end_reason == EndReason.STALE and "max_lease_age" in (stale.end_note or "")
            assert (await client.get_lease(young.key, owner=f"{ns}w")).held
            with pytest.raises(permits.LeaseLost):
                await client.extend(old, 60, owner=f"{ns}w")

    _run(scenario())


def test_cleanup_deletes_old_ended_leases_and_history_in_batches(db_url: str, ns: str) -> None:
    async def scenario() -> None:
        config = ServerConfig(
            database_url=db_url,
            maintenance=Maintenance(keep_ended_leases=0.2, keep_capacity_history=0.2, cleanup_batch=2),
            dashboard=Dashboard(enabled=False),
        )
        state = ServiceState.build(config)
        async with state.client as client:
            await client.create_semaphore(f"{ns}s", 10)
            ended = [await client.acquire(f"{ns}s", ttl=60, owner=f"{ns}w") for _ in range(5)]
            for lease in ended:
                await client.release(lease, owner=f"{ns}w")
            held = await client.acquire(f"{ns}s", ttl=60, owner=f"{ns}w")
            await client.set_capacity(f"{ns}s", 11, reason="more")

            def an_admin_action() -> Flow[None]:
                yield observe.log_admin("tester", "set_capacity", f"{ns}s", "more")

            await state.sql_store.run_flow(an_admin_action)
            await asyncio.sleep(0.4)
            maintainer = Maintainer(state)
            summary = await maintainer.cleanup()
            assert summary["leases_deleted"] >= 5 and summary["history_deleted"] >= 2
            # The admin log goes with the capacity history, with the dashboard (and its stats task) off.
            assert summary["admin_log_deleted"] >= 1
            log = await state.sql_store.run_flow(lambda: observe.admin_log(f"{ns}s", 10), readonly=True)
            assert log == []
            for lease in ended:
                with pytest.raises(permits.LeaseNotFound):
                    await client.get_lease(lease.key, owner=f"{ns}w")
            assert (await client.get_lease(held.key, owner=f"{ns}w")).held  # held leases are never deleted
            assert await client.capacity_history(f"{ns}s") == []
            # Tokens carry on above every deleted lease's.
            fresh = await client.acquire(f"{ns}s", ttl=60, owner=f"{ns}w")
            assert fresh.token > held.token > max(lease.token for lease in ended)
            assert await client.reconcile() == []

    _run(scenario())
