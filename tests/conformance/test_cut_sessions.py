"""Ending the server session of a connection whose link the reply deadline cut (the store's
``_end_cut_sessions``; tests/faults/test_connection_cut.py shows what it is for, over a stalled link). Here
the statements behind it, on each server: every new connection notes its session, a noted session is ended
and no other, and a session on a server this connection did not reach is left alone, with a warning."""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import permits
from permits._sync.store import _CutSession

pytestmark = pytest.mark.usefixtures("servers")


@pytest.fixture(params=["mysql", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    """Overrides the conftest fixture: SQLite has no server sessions."""
    return str(request.param)


@pytest.fixture
def store(db_url: str) -> Iterator[Any]:
    with permits.connect(db_url, owner="cut") as client:
        client.list_semaphores()  # opened
        yield client._store


def _checked_out(store: Any) -> Any:
    return store._engine.raw_connection()


def _list_cut(store: Any, where: dict[str, Any]) -> Any:
    """List a session as ``_note_cut`` does when the deadline cuts its link."""
    cut = _CutSession(where)
    store._cut.append(cut)
    return cut


def _answers(connection: Any) -> bool:
    cursor = connection.driver_connection.cursor()
    try:
        cursor.execute("SELECT 1")
        return cursor.fetchall() is not None
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            cursor.close()


def test_each_new_connection_notes_its_server_session(store: Any, backend: str) -> None:
    connection = _checked_out(store)
    try:
        session = store._sessions[connection.driver_connection]
        expected = {"id", "host", "server", "booted"} if backend == "mysql" else {"id", "started", "server"}
        assert set(session) == expected
        assert all(value is not None for value in session.values())
    finally:
        connection.close()


def test_a_noted_session_is_ended_and_no_other(store: Any) -> None:
    victim, bystander = _checked_out(store), _checked_out(store)
    heard: list[str] = []
    store.on_reply_cut = heard.append
    try:
        _list_cut(store, store._sessions[victim.driver_connection])
        store._end_cut_sessions([])
        assert store._cut == []
        assert heard == ["ended"]
        assert not _answers(victim), "the session is still there"
        assert _answers(bystander)
    finally:
        victim.invalidate()
        bystander.close()


def _left_alone(store: Any, caplog: pytest.LogCaptureFixture, **changes: Any) -> None:
    """A connection's session, noted with ``changes`` as if on another server, is not ended."""
    victim = _checked_out(store)
    heard: list[str] = []
    store.on_reply_cut = heard.append
    try:
        session: dict[str, Any] = {**store._sessions[victim.driver_connection], **changes}
        _list_cut(store, session)
        with caplog.at_level(logging.WARNING, logger="permits"):
            store._end_cut_sessions([])
        assert store._cut == []
        assert heard == ["other_server"]
        assert "did not reach" in caplog.text
        assert _answers(victim)
    finally:
        victim.close()


def test_a_session_on_a_server_this_connection_did_not_reach_is_left_alone(
    store: Any, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Through a load balancer, the connection that ends a session may reach another node, where the same
    connection id names another client's session: nothing is ended there."""
    other = "another server's uid" if backend == "mysql" else datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)
    _left_alone(store, caplog, server=other)


@pytest.mark.parametrize("backend", ["mysql"])  # PostgreSQL tells servers apart by their start alone
@pytest.mark.parametrize("shift", [-100, 100])
def test_a_server_of_the_same_uid_that_started_at_another_time_is_another_server(
    store: Any, caplog: pytest.LogCaptureFixture, shift: int
) -> None:
    """MariaDB: the uid is a hash of a MAC address and a port, which a restarted server keeps and two
    containers may share; the start time tells them apart, whichever started first."""
    victim = _checked_out(store)
    booted = int(store._sessions[victim.driver_connection]["booted"])
    victim.close()
    _left_alone(store, caplog, booted=booted + shift)


def test_a_session_that_is_gone_already_is_done_with(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    victim = _checked_out(store)
    session = store._sessions[victim.driver_connection]
    victim.invalidate()  # closed by the client: the server ends the session
    heard: list[str] = []
    store.on_reply_cut = heard.append
    _list_cut(store, session)
    with caplog.at_level(logging.WARNING, logger="permits"):
        store._end_cut_sessions([])
    assert store._cut == []
    assert heard in (["gone"], ["ended"])  # "ended" if the server had not yet seen the client go
    assert caplog.text == ""


def test_other_operations_do_not_wait_while_a_cut_session_is_being_ended(store: Any) -> None:
    """Another caller holds the session's ending (a session slow to go, say): an operation whose own
    attempt was not cut goes on at once and leaves the session to that caller."""
    victim = _checked_out(store)
    cut = _list_cut(store, store._sessions[victim.driver_connection])
    cut.ending.acquire()
    try:
        done = threading.Event()
        other = threading.Thread(target=lambda: (store.list_semaphores(""), done.set()), daemon=True)
        other.start()
        assert done.wait(10), "an operation that was not cut waited for another caller's ending"
        assert store._cut == [cut] and not cut.settled
        assert _answers(victim)
    finally:
        cut.ending.release()
        victim.invalidate()


def _waits_for_the_ending(store: Any, cut: Any, victim: Any, operation: Callable[[], Any]) -> None:
    """Another caller holds ``cut``'s ending: ``operation`` must not go on while the cut request may still
    run, and once that caller lets go without having settled the session, it ends the session itself."""
    cut.ending.acquire()
    done = threading.Event()
    waiting = threading.Thread(target=lambda: (operation(), done.set()), daemon=True)
    try:
        waiting.start()
        assert not done.wait(1), "went on while the session could still run the cut request"
        assert _answers(victim)
    finally:
        cut.ending.release()
    assert done.wait(10)
    assert cut.settled and store._cut == []
    assert not _answers(victim), "the session is still there"
    victim.invalidate()


def test_the_operation_whose_attempt_was_cut_waits_for_its_own_session(store: Any) -> None:
    """The cut attempt's retry must not be answered while its request may still run: it waits for the
    caller ending its session, and once that caller lets go without having settled it, ends it itself."""
    victim = _checked_out(store)
    cut = _list_cut(store, store._sessions[victim.driver_connection])
    _waits_for_the_ending(store, cut, victim, lambda: store._end_cut_sessions([cut]))


def test_a_session_ended_by_another_caller_is_not_ended_again(store: Any) -> None:
    victim = _checked_out(store)
    cut = _list_cut(store, store._sessions[victim.driver_connection])
    heard: list[str] = []
    store.on_reply_cut = heard.append
    store._end_cut_sessions([])  # another operation got to it first
    store._end_cut_sessions([cut])  # the retry of the cut one
    assert heard == ["ended"]
    victim.invalidate()


def test_an_operation_over_leaves_its_cut_session_abandoned(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operation whose attempt was cut and which then gave up (here the database is unreachable, as far
    as it knows) no longer waits for its session's ending: it marks the session abandoned, for whatever
    operation comes next, which may be the same call made again."""
    victim = _checked_out(store)

    def cut_then_unreachable(flow: Any, readonly: bool, cuts: list[Any], *_: Any) -> Any:
        store._note_cut(victim.driver_connection, cuts)
        raise permits.StorageUnavailable("the link stalled and no new one answers", url=store.url)

    monkeypatch.setattr(store, "_attempt", cut_then_unreachable)
    with pytest.raises(permits.StorageUnavailable):
        store.list_semaphores("")
    monkeypatch.undo()
    try:
        [cut] = store._cut
        assert cut.abandoned and not cut.settled
        store.list_semaphores("")  # the next operation ends it
        assert cut.settled and store._cut == []
        assert not _answers(victim), "the session is still there"
    finally:
        victim.invalidate()


def test_every_operation_waits_for_an_abandoned_session(store: Any) -> None:
    """Another caller is ending a session whose operation gave up. The next operation may be that call
    made again with the same key, and it must not be answered while the cut request may still run: it
    waits for that caller, whatever it is, and ends the session itself if that caller lets go without
    having settled it."""
    victim = _checked_out(store)
    cut = _list_cut(store, store._sessions[victim.driver_connection])
    cut.abandoned = True
    _waits_for_the_ending(store, cut, victim, lambda: store.list_semaphores(""))
