"""The dashboard's pure parts: histograms and percentiles, the per-minute charts, and the event feed's
assembly (cursor, repeats, cut leases, the service's own leases)."""

from __future__ import annotations

import pytest

from permits._core import observe
from permits.server import events

MINUTE = observe.MINUTE_MS
NOW = 1_800_000_000_000 - 1_800_000_000_000 % MINUTE + 30_000  # half past a minute


def test_histogram_percentiles_interpolate_within_a_bucket() -> None:
    hist = observe.wait_histogram()
    assert observe.histogram_percentile(hist, 0.5) is None
    for value in (1, 2, 3, 4):  # all in the first bucket, 0-5 ms
        observe.histogram_add(hist, value)
    assert observe.histogram_percentile(hist, 0.5) == pytest.approx(2.5)
    observe.histogram_add(hist, 10**9)  # the open last bucket answers its lower bound
    assert observe.histogram_percentile(hist, 1.0) == observe.WAIT_BUCKETS_MS[-1]
    assert observe.histogram_parse(observe.histogram_text(hist)) == hist
    assert observe.histogram_parse("1,2,3") == observe.wait_histogram()  # other buckets: ignored
    assert observe.histogram_parse("x") == observe.wait_histogram()


def test_exact_percentiles_are_nearest_rank() -> None:
    assert observe.percentile([], 0.5) is None
    assert observe.percentile([5, 1, 3], 0.5) == 3
    assert observe.percentile(list(range(1, 101)), 0.99) == 99


def test_minute_points_count_grants_by_the_token_rise_and_merge_instances() -> None:
    first_minute = NOW - NOW % MINUTE - MINUTE
    samples = [
        # bucket, capacity, used, waiting, last_token, ended, hold p50, p99
        (first_minute + 10_000, 10, 5, 0, 100, 2, 1000, 2000),
        (first_minute + 50_000, 10, 10, 0, 110, 3, 3000, 4000),
        (NOW - 5_000, 10, 0, 0, 125, 1, 500, 500),
    ]
    hist = observe.wait_histogram()
    observe.histogram_add(hist, 7)
    seen = [
        ("a", "s", NOW - 20_000, 4, 2, 1, 0, observe.histogram_text(hist), NOW),
        ("b", "s", NOW - 10_000, 3, 1, 0, 0, observe.histogram_text(hist), NOW),
    ]
    points = observe.minute_points(samples, seen, NOW, 3)
    assert [p["t_ms"] for p in points] == [first_minute - MINUTE, first_minute, first_minute + MINUTE]
    assert points[0]["util"] is None and points[0]["grants"] is None
    assert points[1]["util"] == pytest.approx(0.75) and points[1]["grants"] == 10
    assert points[1]["hold_p50_ms"] == 3000 and points[1]["hold_p99_ms"] == 4000
    now = points[2]
    assert (now["grants"], now["refused"], now["timeouts"]) == (15, 3, 1)
    assert 5 <= now["wait_p50_ms"] <= 10
    # An instance that saw more grants than the token rise shows (the semaphore's first sample): its count.
    assert observe.minute_points(samples[2:], seen, NOW, 1)[0]["grants"] == 7


def test_waiting_instances_and_rates_read_only_fresh_reports() -> None:
    rows = [
        ("a", "", NOW - 1_000, 0, 0, 0, 0, "", NOW),
        ("b", "", NOW - 100_000, 0, 0, 0, 0, "", NOW),  # a stale heartbeat: not up
        ("a", "s", NOW - 25_000, 0, 1, 0, 9, "", NOW),
        ("a", "s", NOW - 2_000, 0, 2, 1, 4, "", NOW),  # a's latest report wins
        ("b", "s", NOW - 3_000, 0, 0, 0, 2, "", NOW),
    ]
    assert observe.instances_up(rows, NOW, 30_000) == 1
    assert observe.waiting_now(rows, NOW, 30_000) == {"s": 6}
    assert observe.per_minute_rates(rows, NOW, 5 * MINUTE)["s"] == pytest.approx((3 / 5, 1 / 5))


def test_utilisation_by_minute_places_each_minute_in_its_slot() -> None:
    this_minute = NOW - NOW % MINUTE
    rows = [("s", this_minute, 0.5), ("s", this_minute - 2 * MINUTE, 1.0), ("s", this_minute - 99 * MINUTE, 1.0)]
    assert observe.utilisation_by_minute(rows, NOW, 3)["s"] == [1.0, None, 0.5]


def _grant(lease_id: int, name: str, at: int = 1000) -> tuple[object, ...]:
    return (lease_id, "owner", f"k{lease_id}", at, name, 1, lease_id)


def _end(lease_id: int, name: str, at: int) -> tuple[object, ...]:
    return (lease_id, "owner", f"k{lease_id}", at, "released", None, name, 1, lease_id)


def test_the_feed_moves_its_cursor_past_what_it_read_and_skips_what_it_sent() -> None:
    start = events.Cursor(0, 0, 0, 0)
    batch = events.assemble(
        start,
        [_grant(1, "s"), _grant(2, "permits:maintenance:sweep")],
        [_end(1, "s", 2000), _end(3, "s", 1500)],
        [(7, "s", 1, 2, "ops", "more", 1800)],
        [],
        sent_ends={3},
    )
    assert [(e["type"], e.get("lease_id")) for e in batch.events] == [("grant", 1), ("capacity", None), ("end", 1)]
    # The service's own lease is not listed, but the cursor moves past it.
    assert batch.cursor == events.Cursor(2, 2000, 7, 0)
    assert str(events.Cursor.parse(str(batch.cursor))) == str(batch.cursor)


def test_a_lease_cut_by_the_read_limit_is_left_whole_for_the_next_read() -> None:
    rows = [_grant(i, "s") for i in range(1, events.MAX_ROWS_PER_POLL)] + [_grant(events.MAX_ROWS_PER_POLL, "t")]
    batch = events.assemble(events.Cursor(0, 0, 0, 0), rows, [], [], [], set())
    listed = [e["lease_id"] for e in batch.events if e["type"] == "grant"]
    assert listed[-1] == events.MAX_ROWS_PER_POLL - 1
    assert batch.cursor.lease_id == events.MAX_ROWS_PER_POLL - 1
    assert batch.skipped and batch.events[-1]["type"] == "resync"


def test_a_cursor_that_is_not_one_is_refused() -> None:
    for text in ("", "g1.e2.c3", "g1.e2.c3.a4; DROP", "g-1.e2.c3.a4", "g" + "9" * 20 + ".e1.c1.a1"):
        with pytest.raises(Exception) as raised:
            events.Cursor.parse(text)
        assert getattr(raised.value, "code", None) == "invalid_argument"
