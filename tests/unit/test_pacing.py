"""The waiting policy (permits._pacing): pure, so every rule is checked here with a seeded random."""

from __future__ import annotations

import random

from permits._pacing import (
    IN_LINE_TRIES,
    NEXT_SINCE_SHARE,
    QUEUE_MAX_SLEEP,
    QUEUE_MIN_SLEEP,
    QUIET_AFTER_LOST_RACES,
    QUIET_SECONDS,
    RACE_SPREAD_BASE,
    RECHECK_SECONDS,
    WaitPacer,
)


def pacer(**kwargs: object) -> WaitPacer:
    return WaitPacer(rng=random.Random(7), **kwargs)  # type: ignore[arg-type]


def test_the_first_attempt_and_one_a_second_after_are_full_rechecks() -> None:
    p = pacer()
    assert p.recheck_due(100.0)
    assert not p.recheck_due(100.5)
    assert p.recheck_due(100.0 + RECHECK_SECONDS)
    p.force_recheck()
    assert p.recheck_due(101.1)


def test_an_unqueued_waiter_backs_off_and_listens() -> None:
    p = pacer()
    p.refused(0.0, None)
    first, listen = p.next_sleep(0.0)
    assert listen and 0 < first <= 0.02
    for _ in range(10):
        p.refused(0.0, None)
    later, _ = p.next_sleep(0.0)
    assert 0.5 <= later <= 1.0


def test_woken_waiters_spread_their_retries_only_after_losing_races() -> None:
    p = pacer()
    assert p.woken() == 0.0  # no race lost yet: ask at once
    p.refused(1.0, None)  # told of room, found none: a lost race
    assert p.lost_races == 1
    assert 0 <= p.woken() <= RACE_SPREAD_BASE
    now = 1.0
    for _ in range(QUIET_AFTER_LOST_RACES - 1):
        now += 0.1
        p.refused(now, None)
        p.woken()
    # Enough lost races: stop listening for a while (the count starts again).
    assert p.quiet_until == now + QUIET_SECONDS
    assert p.next_sleep(now + 1)[1] is False
    assert p.next_sleep(now + QUIET_SECONDS)[1] is True


def test_a_grant_after_no_wait_narrows_the_spread_and_one_after_a_wait_keeps_it() -> None:
    waited = pacer(lost_races=1)
    waited.refused(0.0, None)
    waited.granted()
    assert waited.lost_races == 1
    at_once = pacer(lost_races=1)
    at_once.granted()
    assert at_once.lost_races == 0


def test_a_queued_waiter_sleeps_by_its_place_and_only_the_next_in_line_listens() -> None:
    p = pacer()
    p.refused(0.0, 20)
    sleep, listen = p.next_sleep(0.0)  # no rate measured yet: plain backoff, no listening
    assert not listen and sleep <= QUEUE_MAX_SLEEP
    p.refused(0.1, 10)  # 10 permits came back in 0.1 s: 100 per second
    assert p.rate == 100.0
    sleep, listen = p.next_sleep(0.1)
    assert not listen and abs(sleep - 10 / 100 / 2) < 1e-9  # half the predicted time
    p.refused(0.15, 1)
    sleep, listen = p.next_sleep(0.15)
    assert listen and sleep >= QUEUE_MIN_SLEEP
    p.refused(0.2, 0)  # it fits now: ask again at once
    assert p.next_sleep(0.2) == (0.0, False)


def test_a_waiter_that_fits_its_fair_queue_but_is_refused_again_backs_off() -> None:
    """Fitting its fair queue and still refused: the room it lacks is elsewhere (a plain semaphore of the
    same request is full). It asks again at once only the first time, then backs off as any waiter does,
    instead of a write per loop (measured: 18,000 attempts in 2 s on SQLite before)."""
    p = pacer()
    p.refused(0.0, 0)
    assert p.next_sleep(0.0) == (0.0, False)
    delays = []
    for step in range(1, 8):
        p.refused(step * 0.1, 0)
        delay, listen = p.next_sleep(step * 0.1)
        assert listen
        delays.append(delay)
    assert 0.01 <= delays[0] <= 0.02 and delays[-1] >= 0.5, delays
    p.refused(1.0, 3)  # its queue moved on without it: short again, and the count starts over
    assert p.fitting_refusals == 0


def test_a_queue_that_stops_moving_slows_its_waiters_to_the_cap() -> None:
    p = pacer()
    p.refused(0.0, 5)
    for step in range(1, 12):
        p.refused(step * 1.0, 5)  # nothing comes back
    assert p.rate == 0
    sleep, _ = p.next_sleep(12.0)  # back to the plain backoff, which by now is near its cap
    assert QUEUE_MAX_SLEEP / 2 <= sleep <= QUEUE_MAX_SLEEP


def test_the_next_waiter_asks_again_within_half_the_time_since_it_became_next_however_slow_its_queue_was() -> None:
    """One slow holder leaves every waiter with a low rate. The one now next (one permit short) does not
    sleep by it: it asks within ``NEXT_SINCE_SHARE`` of the time since it became next, so the permit that
    comes back is taken within about that much of the hold, and the queue speeds up again. The others
    still sleep by their rate."""
    p = pacer()
    p.refused(0.0, 3)
    p.refused(1.0, 2)  # one permit in a second: a slow queue
    assert p.rate == 1.0
    assert p.next_sleep(1.0)[0] == 1.0  # two permits short: half its predicted 2 s
    p.refused(2.0, 1)  # next now
    sleep, listen = p.next_sleep(2.0)
    assert listen and sleep == QUEUE_MIN_SLEEP  # (by its rate: 0.5 s)
    elapsed = 0.0
    for _ in range(6):
        elapsed += sleep
        p.refused(2.0 + elapsed, 1)
        sleep, _ = p.next_sleep(2.0 + elapsed)
        assert abs(sleep - max(QUEUE_MIN_SLEEP, NEXT_SINCE_SHARE * elapsed)) < 1e-9
    assert sleep < 0.1
    p.refused(2.5, 0)  # its turn
    assert p.next_sleep(2.5) == (0.0, False)
    p.refused(2.6, 2)  # passed over after all (another request of the same queue came first): by its rate again
    assert p.next_sleep(2.6)[0] > 0.1
    p.refused(3.0, 1)  # next again: the time counts from now, not from when it was next before
    assert p.next_sleep(3.0)[0] == QUEUE_MIN_SLEEP
    p.refused(3.2, None)  # no longer queued (its place lapsed): no such bound
    p.refused(3.3, 1)
    assert p.next_sleep(3.3)[0] == QUEUE_MIN_SLEEP


def test_a_waiter_asks_in_the_servers_line_until_refused_there_in_line_tries_times_in_a_row() -> None:
    p = pacer()
    assert p.in_line_next()  # the first attempt goes in the line
    for _ in range(IN_LINE_TRIES - 1):
        p.refused(0.0, None)
        assert p.in_line_next()  # refused in the line: ask again at once, in the line
    p.refused(0.0, None)
    assert not p.in_line_next()  # the permits are held longer than the line takes to turn: wait instead
    p.refused(0.0, None)  # an attempt out of the line does not count against the line
    assert p.in_line_refusals == IN_LINE_TRIES
    assert not p.in_line_next()  # a sleep that ends without a release does not send it back


def test_each_release_sends_a_waiter_that_left_the_line_back_for_one_try() -> None:
    p = pacer()
    for _ in range(IN_LINE_TRIES):
        assert p.in_line_next()
        p.refused(0.0, None)
    assert not p.in_line_next()
    p.woken()
    assert p.in_line_next()  # one try
    p.refused(0.0, None)
    assert not p.in_line_next()  # and back to waiting for a release
    p.woken()
    assert p.in_line_next()


def test_a_waiter_in_a_fair_queue_waits_for_its_turn_there_and_not_in_the_line() -> None:
    p = pacer()
    p.refused(0.0, 2)  # it holds a place, two permits short
    assert not p.in_line_next()
