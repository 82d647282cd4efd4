"""The object that ``lease()`` and ``mutex()`` return: one holder's at a time, reusable in turn, and
``max_hold`` enforced from the grant on, on every backend, directly and through the service, sync and
asyncio."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import permits
from tests._service import wait_until


@pytest.fixture(params=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_one_mutex_object_shared_by_threads_lets_one_in_and_refuses_the_rest(
    make_client: Callable[..., Any], ns: str
) -> None:
    """Shared like a threading.Lock, one object would hand every thread the same lease (one key is one
    request): all of them inside at once. Only the first gets in; the others are told why."""
    client = make_client(owner=f"{ns}o")
    client.create_mutex(f"{ns}m")
    lock = client.mutex(f"{ns}m", ttl=30, timeout=5)
    inside: list[int] = []
    most = [0]
    refused: list[Exception] = []
    entered = threading.Barrier(3)

    def hold(i: int) -> None:
        entered.wait()
        try:
            with lock:
                inside.append(i)
                most[0] = max(most[0], len(inside))
                time.sleep(0.5)
                inside.remove(i)
        except permits.UsageError as exc:
            refused.append(exc)

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert most[0] == 1
    assert len(refused) == 2 and "one holder's at a time" in str(refused[0])
    assert client.get_semaphore(f"{ns}m").used == 0


def test_entering_a_held_mutex_again_inside_its_block_is_refused(make_client: Callable[..., Any], ns: str) -> None:
    client = make_client(owner=f"{ns}o")
    client.create_mutex(f"{ns}m")
    lock = client.mutex(f"{ns}m", ttl=30)
    with lock as lease:
        with pytest.raises(permits.UsageError), lock:
            pass
        assert client.try_acquire(f"{ns}m") is None  # the outer block still holds it
        assert client.get_lease(lease.key).held
    assert client.get_semaphore(f"{ns}m").used == 0


def test_a_mutex_object_is_taken_again_in_turn_under_a_new_key(make_client: Callable[..., Any], ns: str) -> None:
    client = make_client(owner=f"{ns}o")
    client.create_mutex(f"{ns}m")
    lock = client.mutex(f"{ns}m", ttl=30)
    with lock as first:
        pass
    with lock as second:
        assert second.key != first.key and second.token > first.token
    assert client.get_lease(second.key).end_reason == permits.EndReason.RELEASED


def test_max_hold_shorter_than_the_ttl_ends_the_lease_at_max_hold(make_client: Callable[..., Any], ns: str) -> None:
    """Extends cannot shorten a grant's TTL: the grant itself asks for no more than max_hold."""
    client = make_client(owner=f"{ns}o")
    client.create_mutex(f"{ns}m")
    lost: list[str] = []
    started = time.monotonic()
    with client.mutex(f"{ns}m", ttl=30, max_hold=1, on_lost=lost.append) as lease:
        assert lease.expires_in <= 1.0
        wait_until(lambda: lost, timeout=10, interval=0.02)
    assert lost == ["max_hold"] and time.monotonic() - started < 5
    assert client.try_acquire(f"{ns}m") is not None  # its permit is free


def test_a_cancelled_acquire_releases_what_its_last_attempt_was_granted(
    client_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled after its grant committed and before it returned, an acquire under a key it made up
    must not leave that grant held, under a key nobody knows, until its TTL."""

    async def scenario() -> tuple[int, int]:
        async with permits.connect_async(client_url, owner=f"{ns}o") as client:
            await client.create_semaphore(f"{ns}s", 2)
            store: Any = client._store  # type: ignore[attr-defined]
            granted = asyncio.Event()
            real = store.try_acquire

            async def then_linger(*args: Any, **kwargs: Any) -> Any:
                lease = await real(*args, **kwargs)
                granted.set()
                await asyncio.sleep(30)  # the window between the commit and the return, held open
                return lease

            monkeypatch.setattr(store, "try_acquire", then_linger)
            task = asyncio.create_task(client.acquire(f"{ns}s", ttl=60, timeout=10))
            await asyncio.wait_for(granted.wait(), 20)
            used_when_granted = (await client.get_semaphore(f"{ns}s")).used
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return used_when_granted, (await client.get_semaphore(f"{ns}s")).used

    assert asyncio.run(scenario()) == (1, 0)


@pytest.mark.parametrize("how", ["acquire", "lease"])
def test_a_cancelled_request_for_a_new_lease_only_releases_its_own_grant_and_no_other(
    client_url: str, ns: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled after its grant committed and before it returned, a ``new_only`` acquire under the caller's
    key releases the lease its request got (its request id tells it from any other), so that the key's
    permits do not wait for the TTL; cancelled before any grant, it leaves alone a lease that another
    request took under that key meanwhile."""

    async def scenario() -> tuple[int, int, int]:
        async with permits.connect_async(client_url, owner=f"{ns}o") as client:
            name = f"{ns}s"
            await client.create_semaphore(name, 2)
            store: Any = client._store  # type: ignore[attr-defined]
            asked = asyncio.Event()
            real = store.try_acquire
            grants = [True]

            async def then_linger(*args: Any, **kwargs: Any) -> Any:
                lease = await real(*args, **kwargs) if grants[0] else None
                asked.set()
                await asyncio.sleep(30)  # the window between the commit and the return, held open
                return lease

            async def cancelled(key: str) -> None:
                asked.clear()
                if how == "acquire":
                    request = client.acquire(name, key=key, ttl=60, timeout=10, new_only=True)
                else:

                    async def hold() -> None:
                        async with client.lease(name, key=key, ttl=60, timeout=10, new_only=True):
                            pass

                    request = hold()
                task = asyncio.create_task(request)
                await asyncio.wait_for(asked.wait(), 20)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

            monkeypatch.setattr(store, "try_acquire", then_linger)
            await cancelled(f"{ns}k1")
            after_own = (await client.get_semaphore(name)).used
            ended = await client.get_lease(f"{ns}k1")
            assert str(ended.end_reason) == "released", ended
            # Refused, as far as the request knew, while another request took the key's lease: that one stays.
            grants[0] = False
            monkeypatch.setattr(store, "try_acquire", real)
            other = await client.acquire(name, key=f"{ns}k2", ttl=60)
            monkeypatch.setattr(store, "try_acquire", then_linger)
            await cancelled(f"{ns}k2")
            after_other = (await client.get_semaphore(name)).used
            assert (await client.release(other)) is permits.ReleaseOutcome.RELEASED
            return after_own, after_other, (await client.get_semaphore(name)).used

    assert asyncio.run(scenario()) == (0, 1, 0)


def test_a_block_that_outlived_its_lease_says_so_at_its_end(make_client: Callable[..., Any], ns: str) -> None:
    """With no watchdog to extend it, a lease whose TTL ran out inside its block let its work go on
    unprotected (another holder may have got in): the block's end raises ``LeaseLost`` (reason
    ``expired``), as redis-py's release raises ``LockNotOwnedError``, rather than return as if all was well.
    A block that raised says its own error instead; one that ended in time says nothing."""
    client = make_client(owner=f"{ns}o")
    client.create_mutex(f"{ns}m")
    with pytest.raises(permits.LeaseLost) as lost, client.mutex(f"{ns}m", ttl=0.5) as lease:
        time.sleep(1.2)
        other = client.try_acquire(f"{ns}m", owner=f"{ns}other")
        assert other is not None  # let in beside the block
    assert lost.value.reason == "expired" and lost.value.details["key"] == lease.key
    client.release(other, owner=f"{ns}other")
    with pytest.raises(ZeroDivisionError), client.mutex(f"{ns}m", ttl=0.5):
        time.sleep(1.2)
        raise ZeroDivisionError
    with client.mutex(f"{ns}m", ttl=30):
        pass


def test_a_revoked_lease_is_said_lost_at_the_end_of_its_block(make_client: Callable[..., Any], ns: str) -> None:
    client = make_client(owner=f"{ns}o")
    client.create_mutex(f"{ns}m")
    with pytest.raises(permits.LeaseLost) as lost, client.mutex(f"{ns}m", ttl=30) as lease:
        client.revoke(lease.key, owner=f"{ns}o", reason="runaway")
    assert lost.value.reason == "revoked"
