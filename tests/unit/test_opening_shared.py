"""Callers that find a client opening (its first use) wait for that opening, and share its failure only
where it is their answer too (``SQLStore._answers_this_caller``, ``permits._deadline``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import permits
from permits import StorageUnavailable
from permits._deadline import caller_deadline, store_grace
from permits._sync.store import CUT_BY_CALLER_DEADLINE, SQLStore

#: the point of giving up is this long after a deadline, with the default lock wait
GRACE = store_grace(5.0)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLStore]:
    with permits.connect(f"sqlite:///{tmp_path / 'p.db'}") as client:
        yield client._store  # type: ignore[attr-defined]


def _failing_opening(store: SQLStore, seconds: float, cut: bool, opened: list[float]) -> None:
    """Each opening takes ``seconds`` and fails, cut short by its caller's deadline or not."""

    def fail() -> None:
        opened.append(time.monotonic())
        time.sleep(seconds)
        error = StorageUnavailable("the database did not answer")
        if cut:
            setattr(error, CUT_BY_CALLER_DEADLINE, True)
        raise error

    store._open = fail  # type: ignore[method-assign]
    store._opened = False  # as a new client's, before its first use


def _open_in_thread(store: SQLStore, deadline: float | None, outcome: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        with caller_deadline(deadline):
            try:
                store.open()
            except Exception as exc:  # the test reads it
                outcome["error"] = exc
            outcome["ended"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _first_then_second(store: SQLStore, first: float | None, second: float | None) -> dict[str, Any]:
    ones: dict[str, Any] = {}
    twos: dict[str, Any] = {}
    one = _open_in_thread(store, first, ones)
    time.sleep(0.2)  # the first holds the opening
    two = _open_in_thread(store, second, twos)
    one.join(30)
    two.join(30)
    assert isinstance(ones.get("error"), StorageUnavailable) and isinstance(twos.get("error"), StorageUnavailable)
    return twos


def test_an_opening_that_used_its_retries_is_the_answer_of_those_that_waited(store: SQLStore) -> None:
    opened: list[float] = []
    _failing_opening(store, 1.0, cut=False, opened=opened)
    _first_then_second(store, None, time.monotonic() + 60)
    assert len(opened) == 1


def test_an_opening_its_callers_deadline_cut_short_is_not_the_answer_of_one_with_more_time(
    store: SQLStore,
) -> None:
    opened: list[float] = []
    _failing_opening(store, 1.0, cut=True, opened=opened)
    soon = time.monotonic()
    _first_then_second(store, soon, None)  # no deadline: its whole retries
    _first_then_second(store, soon, soon + 30)  # a later one
    assert len(opened) == 4


def test_callers_with_the_same_deadline_share_an_opening_it_cut_short(store: SQLStore) -> None:
    opened: list[float] = []
    _failing_opening(store, 1.0, cut=True, opened=opened)
    deadline = time.monotonic() + 2
    _first_then_second(store, deadline, deadline + 0.5)
    assert len(opened) == 1


def test_a_caller_waits_for_another_callers_opening_no_longer_than_its_own_point(store: SQLStore) -> None:
    opened: list[float] = []
    _failing_opening(store, 3.0, cut=False, opened=opened)
    began = time.monotonic()
    twos = _first_then_second(store, None, began - GRACE + 1.0)  # its point: a second from now
    assert "still reaching" in str(twos["error"])
    assert twos["ended"] - began < 2.5  # not the opening's 3 s
    assert len(opened) == 1
