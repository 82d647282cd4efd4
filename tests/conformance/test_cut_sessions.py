"""Ending the server session of a connection whose link the reply deadline cut (the store's
``_end_cut_sessions``; tests/faults/test_connection_cut.py shows what it is for, over a stalled link). Here
the statements behind it, on each server: every new connection notes its session, a noted session is ended
and no other, and a session on a server this connection did not reach is left alone, with a warning."""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterator
from typing import Any

import pytest

import permits

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
        store._cut.append(store._sessions[victim.driver_connection])
        store._end_cut_sessions()
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
        store._cut.append(session)
        with caplog.at_level(logging.WARNING, logger="permits"):
            store._end_cut_sessions()
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
    store._cut.append(session)
    with caplog.at_level(logging.WARNING, logger="permits"):
        store._end_cut_sessions()
    assert store._cut == []
    assert heard in (["gone"], ["ended"])  # "ended" if the server had not yet seen the client go
    assert caplog.text == ""
