"""The caller's deadline that the stores hold to (``permits._deadline``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from permits._deadline import (
    CALLER_DEADLINE,
    OVERDUE_GRACE_SECONDS,
    caller_deadline,
    detached,
    give_up_at,
    past_giving_up,
    reply_within,
    store_grace,
    store_least_reply,
    without_caller_deadline,
)
from permits._io import async_spawn

#: a SQL store's, with the default lock wait
GRACE, LEAST = store_grace(5.0), store_least_reply(5.0)


def test_the_grace_and_the_least_wait_for_an_answer_of_a_sql_store() -> None:
    assert GRACE == 5.0 + OVERDUE_GRACE_SECONDS  # one lock wait: a try's
    assert LEAST == 2 * 5.0 + OVERDUE_GRACE_SECONDS  # two: MariaDB's row lock, then its AUTO-INC lock


def test_without_a_deadline_the_stores_own_bounds_apply() -> None:
    assert give_up_at(GRACE) is None
    assert reply_within(20.0, GRACE, LEAST) == 20.0
    assert not past_giving_up(GRACE, pause=1e9)


def test_a_deadline_bounds_replies_and_retries_a_grace_after_it() -> None:
    now = time.monotonic()
    with caller_deadline(now + 30):
        assert give_up_at(GRACE) == pytest.approx(now + 30 + GRACE)
        assert reply_within(60.0, GRACE, LEAST) == pytest.approx(30 + GRACE, abs=0.5)
        assert reply_within(20.0, GRACE, LEAST) == 20.0  # the store's own reply deadline still holds
        assert not past_giving_up(GRACE)
        assert past_giving_up(GRACE, pause=30 + GRACE + 1)
    assert CALLER_DEADLINE.get() is None


def test_an_attempt_sent_late_still_gets_the_least_wait_for_its_answer() -> None:
    with caller_deadline(time.monotonic() - 60):
        assert past_giving_up(GRACE)
        assert reply_within(20.0, GRACE, LEAST) == LEAST


def test_a_block_inside_another_holds_to_the_earlier_deadline_and_shared_work_to_none() -> None:
    with caller_deadline(100.0):
        with caller_deadline(200.0):
            assert CALLER_DEADLINE.get() == 100.0
        with caller_deadline(50.0):
            assert CALLER_DEADLINE.get() == 50.0
        with caller_deadline(None):
            assert CALLER_DEADLINE.get() == 100.0
        with without_caller_deadline():
            assert CALLER_DEADLINE.get() is None
        assert CALLER_DEADLINE.get() == 100.0


def test_work_a_call_starts_for_others_is_not_held_to_its_deadline() -> None:
    async def main() -> tuple[float | None, float | None]:
        seen: list[float | None] = []

        async def background() -> None:
            seen.append(CALLER_DEADLINE.get())

        async def task() -> float | None:
            return CALLER_DEADLINE.get()

        with caller_deadline(123.0):
            await async_spawn(background, "test")
            return seen[0], await asyncio.create_task(task())  # a plain task would be

    assert asyncio.run(main()) == (None, 123.0)
    with caller_deadline(123.0):
        assert detached().run(CALLER_DEADLINE.get) is None
        assert CALLER_DEADLINE.get() == 123.0
