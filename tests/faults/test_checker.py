"""The checker catches what it is meant to: small hand-made histories, each breaking one property.

Each ``Story`` starts consistent (the database's state after the run is derived from the acknowledged
operations), and each test then breaks one thing and expects the matching violation, and only it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.faults import checker
from tests.faults.history import FAIL, OK, UNKNOWN, build

SEM = "s"
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


def _db_time(t: float) -> str:
    return (EPOCH + timedelta(seconds=t)).isoformat()


class Story:
    def __init__(self, capacity: int = 1, ttl: float = 10.0) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self.records: list[dict[str, Any]] = []
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.log: list[tuple[int, int, str]] = []
        self.drift: list[str] = []
        self.end = 1000.0
        self._n = 0

    def _op(self, op: str, proc: str, t0: float, t1: float | None, outcome: str, inv: Any, done: Any) -> None:
        self._n += 1
        op_id = f"{proc}-{self._n}"
        self.records.append({"ev": "invoke", "id": op_id, "op": op, "proc": proc, "t": t0, **inv})
        if t1 is not None:
            self.records.append({"ev": "complete", "id": op_id, "t": t1, "outcome": outcome, **done})

    def acquire(
        self, proc: str, key: str, t0: float, t1: float | None, token: int | None = None, outcome: str = OK, **done: Any
    ) -> None:
        if outcome == OK:
            done.update(token=token, ttl_db=self.ttl)
            if (proc, key) not in self.leases:
                self.stored(proc, key, token, acquired=t0)
        self._op("acquire", proc, t0, t1, outcome, {"owner": proc, "key": key, "sem": SEM}, done)

    def stored(self, proc: str, key: str, token: int | None, acquired: float) -> None:
        """The database holds a lease for (proc, key), granted at ``acquired`` on its clock."""
        self.leases[(proc, key)] = {
            "key": key,
            "counts": {SEM: 1},
            "tokens": {SEM: token},
            "end_reason": None,
            "held": True,
            "acquired_at": _db_time(acquired),
            "expires_at": _db_time(acquired + self.ttl),
            "ended_at": None,
        }

    def release(
        self, proc: str, key: str, t0: float, t1: float | None, outcome: str = OK, result: str = "released"
    ) -> None:
        if outcome == OK:
            self.leases[(proc, key)].update(end_reason="released", held=False, ended_at=_db_time(t0))
        self._op("release", proc, t0, t1, outcome, {"owner": proc, "key": key, "sem": SEM}, {"result": result})

    def write(self, proc: str, wid: str, token: int, t0: float, t1: float | None, outcome: str = OK) -> None:
        done: dict[str, Any] = {}
        if outcome == OK:
            done["version"] = len(self.log) + 1
            self.log.append((done["version"], token, wid))
        self._op("write", proc, t0, t1, outcome, {"resource": "r", "token": token, "wid": wid}, done)

    def kill(self, proc: str, t: float) -> None:
        self.records.append({"ev": "event", "kind": "kill", "proc": "harness", "target": proc, "t": t})

    def violations(self) -> list[str]:
        final = checker.Final(
            t=self.end,
            leases=self.leases,
            register={"r": self.log},
            drift=self.drift,
            capacity={SEM: self.capacity},
            sweep_interval=1.0,
            slack=2.0,
        )
        return checker.check(build(self.records), final).violations


def _only(story: Story, prop: str) -> list[str]:
    found = story.violations()
    assert found, f"the checker found nothing wrong; expected a {prop} violation"
    assert all(v.startswith(prop + ":") for v in found), found
    return found


def _turns(capacity: int = 1) -> Story:
    """Two holders taking turns, writing their tokens: a clean history."""
    story = Story(capacity)
    story.acquire("a", "a1", 0, 1, token=1)
    story.write("a", "a-w1", 1, 1.1, 1.2)
    story.release("a", "a1", 2, 3)
    story.acquire("b", "b1", 2.5, 3.5, token=2)
    story.write("b", "b-w1", 2, 3.6, 3.7)
    story.release("b", "b1", 4, 5)
    return story


def test_a_clean_history_passes() -> None:
    assert _turns().violations() == []


def test_overlapping_definite_holds_beyond_capacity() -> None:
    story = Story(capacity=1)
    story.acquire("a", "a1", 0, 1, token=1)
    story.acquire("b", "b1", 1.5, 2, token=2)  # granted while a1 is definitely held
    story.release("a", "a1", 3, 4)
    story.release("b", "b1", 3, 4)
    found = story.violations()
    assert [v.split(":")[0] for v in found] == ["capacity", "capacity_on_the_database_clock"], found
    assert "2 leases definitely held" in found[0]


def test_unknown_and_expired_holds_do_not_count_towards_capacity() -> None:
    story = Story(capacity=1, ttl=2.0)
    story.acquire("a", "a1", 0, 1, token=1)  # never released: held until its expiry at 0 + 2
    story.acquire("u", "u1", 0.5, None, outcome=UNKNOWN)  # never completed: only possibly held
    story.acquire("b", "b1", 2.5, 3, token=2)  # after a1's expiry
    story.leases[("a", "a1")].update(end_reason="expired", held=False, ended_at=_db_time(2.5))  # b reclaimed it
    story.release("b", "b1", 4, 5)
    assert story.violations() == []


def test_a_grant_nobody_was_told_of_overruns_the_capacity_on_the_database_clock() -> None:
    """The history alone cannot see it: the second acquire timed out, so its lease is only possibly held.
    The database's own times show both leases held at once."""
    story = Story(capacity=1)
    story.acquire("a", "a1", 0, 1, token=1)
    story.acquire("u", "u1", 1.5, 9, outcome=UNKNOWN, error="timeout")
    story.stored("u", "u1", token=2, acquired=1.6)
    story.release("a", "a1", 3, 4)
    found = _only(story, "capacity_on_the_database_clock")
    assert "2 permits of s in use (capacity 1)" in found[0] and "u1#0" in found[0], found


def test_a_lease_ended_for_its_expiry_before_it_expired() -> None:
    story = Story(capacity=1, ttl=5.0)
    story.acquire("a", "a1", 0, 1, token=1)
    story.leases[("a", "a1")].update(end_reason="swept", held=False, ended_at=_db_time(4.0))
    story.release("a", "a1", 6, 7, outcome=FAIL, result="lost")
    assert "a1 was swept at" in _only(story, "ended_for_expiry")[0]


def test_a_later_grant_with_a_lower_token() -> None:
    story = Story(capacity=2)
    story.acquire("a", "a1", 0, 1, token=5)
    story.release("a", "a1", 1, 2)
    story.acquire("b", "b1", 3, 4, token=4)  # asked for after a1 was granted
    story.release("b", "b1", 5, 6)
    assert "got the lower or equal token 4" in _only(story, "token_order")[0]


def test_concurrent_grants_may_come_in_any_token_order() -> None:
    story = Story(capacity=2)
    story.acquire("a", "a1", 0, 2, token=5)
    story.acquire("b", "b1", 1, 3, token=4)  # overlapping calls: either order is fine
    story.release("a", "a1", 4, 5)
    story.release("b", "b1", 4, 5)
    assert story.violations() == []


def test_one_token_handed_to_two_leases() -> None:
    story = Story(capacity=2)
    story.acquire("a", "a1", 0, 2, token=7)
    story.acquire("b", "b1", 1, 3, token=7)
    story.release("a", "a1", 4, 5)
    story.release("b", "b1", 4, 5)
    found = story.violations()
    assert any(v.startswith("token_order: token 7") for v in found), found
    assert any(v.startswith("idempotency: token 7") for v in found), found


def test_a_key_granted_twice() -> None:
    story = Story()
    story.acquire("a", "a1", 0, 1, outcome=UNKNOWN, error="timeout")
    story.acquire("a", "a1", 1, 2, token=1)
    story.acquire("a", "a1", 2, 3, token=2)  # a retry of the same key got a second grant
    story.release("a", "a1", 4, 5)
    found = story.violations()
    assert any("granted 2 times" in v for v in found), found


def test_a_failed_acquire_that_was_granted() -> None:
    story = Story()
    story.acquire("a", "a1", 0, 1, outcome=FAIL, why="no_room")
    story.stored("a", "a1", token=1, acquired=0.5)
    assert "failed for no room, yet it was granted" in _only(story, "idempotency")[0]


def test_the_register_accepts_a_lower_token() -> None:
    story = _turns()
    story.log[1] = (2, 0, "b-w1")  # b's write logged with a token below a's
    story.records = [r for r in story.records if r.get("wid") != "b-w1"]  # not b's own write
    assert any("accepted token 0" in v for v in _only(story, "register")), story.violations()


def test_an_acknowledged_write_missing_from_the_register() -> None:
    story = _turns()
    story.log.pop()
    assert "acknowledged write b-w1" in _only(story, "register")[0]


def test_a_refused_write_in_the_register() -> None:
    story = _turns()
    story.write("a", "a-w2", 1, 6, 7, outcome=FAIL)
    story.log.append((3, 1, "a-w2"))
    found = _only(story, "register")
    assert any("refused write a-w2" in v for v in found), found


def test_register_writes_out_of_real_time_order() -> None:
    story = Story(capacity=2)
    story.write("a", "a-w1", 5, 0, 1)
    story.write("b", "b-w1", 3, 2, 3)  # acknowledged after a's, with a lower token
    story.log[:] = [(1, 3, "b-w1"), (2, 5, "a-w1")]  # the log itself is consistent: b was first there
    story.records = [r for r in story.records if r["ev"] == "invoke"] + [
        {"ev": "complete", "id": "a-1", "t": 1, "outcome": OK, "version": 2},
        {"ev": "complete", "id": "b-2", "t": 3, "outcome": OK, "version": 1},
    ]
    found = _only(story, "register")
    assert any("started after a-w1" in v for v in found), found


def test_an_acknowledged_grant_lost() -> None:
    story = _turns()
    del story.leases[("b", "b1")]
    assert "acknowledged grant b1" in _only(story, "durability")[0]


def test_an_acknowledged_grant_with_another_token() -> None:
    story = _turns()
    story.leases[("b", "b1")]["tokens"] = {SEM: 9}
    assert "the database has 9" in _only(story, "durability")[0]


def test_an_acknowledged_release_lost() -> None:
    story = _turns()
    story.leases[("a", "a1")].update(end_reason=None, held=True)
    assert "acknowledged release of a1 is lost" in _only(story, "durability")[0]


def test_a_release_that_said_lost_but_the_lease_was_held() -> None:
    story = Story()
    story.acquire("a", "a1", 0, 1, token=1)
    story.release("a", "a1", 20, 21, outcome=FAIL, result="lost")
    assert "said lost" in _only(story, "durability")[0]


@pytest.mark.parametrize("ended", [2.8, 32.0])
def test_a_killed_holders_lease_must_end_in_time(ended: float) -> None:
    story = Story(ttl=2.0)
    story.acquire("a", "a1", 0, 1, token=1)
    story.kill("a", 1.5)
    # it expires at 2; the bound is the sweep interval + slack = 3 s past that
    story.leases[("a", "a1")].update(end_reason="swept", held=False, ended_at=_db_time(ended))
    if ended <= 5:
        assert story.violations() == []
    else:
        assert "ended 30.0 s after its expiry" in _only(story, "killed_return")[0]


def test_a_killed_holders_lease_that_never_ended() -> None:
    story = Story(ttl=2.0)
    story.acquire("a", "a1", 0, 1, token=1)
    story.acquire("a", "a2", 1.2, None, outcome=UNKNOWN)  # in flight when killed
    story.kill("a", 1.5)
    assert "a1 of a killed holder has not ended" in _only(story, "killed_return")[0]


def test_drift_at_the_end() -> None:
    story = _turns()
    story.drift.append("Drift(name='s', used=1, held=0)")
    assert _only(story, "reconcile")


def test_a_lease_released_in_the_millisecond_it_was_granted_holds_nothing() -> None:
    """The database stamps in milliseconds: a grant and its release can share one, and the next grant too."""
    story = Story(capacity=1)
    story.acquire("a", "a1", 0, 0.0002, token=1)
    story.release("a", "a1", 0.0003, 0.0004)
    story.acquire("b", "b1", 0.0005, 1, token=2)
    for lease in story.leases.values():  # all three stamped in the same millisecond
        lease["acquired_at"] = _db_time(0)
    story.leases[("a", "a1")]["ended_at"] = _db_time(0)
    story.release("b", "b1", 2, 3)
    assert story.violations() == []
