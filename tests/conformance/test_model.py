"""The library against an in-memory model of it: hypothesis drives random sequences of acquires (with and
without keys, one to several semaphores, counts up to past the capacity), retries with the same key,
releases, extends, capacity changes, sweeps and moves of the clock, and after every step checks the
database's answers and state against the model's.

Time. Leases are timed on the database's clock, so the test moves that clock: on SQLite through a SQL
function (``permits.dialects.sqlite.offset_clock``), on MariaDB and PostgreSQL through a one-row table that
their statements add to the server's clock (``permits.dialects.server_clock``), each on a database of the
test's own. Real time passes as well, so every TTL and every move of the clock is a whole number of
``UNIT`` seconds, far more than one example takes: a lease's expiry then never falls within the real time
that passed of the model's "now", and the model can say exactly which leases have expired. A service runs
in a process of its own, whose clock the test cannot move, so through the service (and once more directly
on every backend) the same machine runs without the moves: nothing expires, everything else is checked
the same.

CI runs a few examples per backend; ``PERMITS_MODEL_EXAMPLES=500`` runs that many on each, randomised
(with hypothesis's example database in ``.hypothesis/``, ignored by git).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import permits
from permits import (
    CountExceedsCapacity,
    IdempotencyConflict,
    InvalidArgument,
    LeaseLost,
    LeaseNotFound,
    ReleaseOutcome,
    SemaphoreNotFound,
)
from permits.dialects.mysql import MariaDB105, MariaDBCluster, MySQL, MySQLCluster
from permits.dialects.server_clock import ServerOffsetClock, server_offset_clock
from permits.dialects.sqlite import OffsetClock, offset_clock
from tests._service import running
from tests.conftest import called_functions, count_function_calls, own_database

#: Seconds: every TTL and every move of the clock is a multiple of this.
UNIT = 60.0
LARGE_RUN = int(os.environ.get("PERMITS_MODEL_EXAMPLES", "0"))


def _settings(examples: int, steps: int) -> settings:
    if LARGE_RUN:
        return settings(max_examples=LARGE_RUN, stateful_step_count=50, deadline=None)
    # CI: the same examples every run, and no example database written.
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


@dataclass
class ModelSemaphore:
    capacity: int
    used: int = 0
    last_token: int = 0


@dataclass
class ModelLease:
    owner: str
    key: str
    counts: dict[str, int]
    tokens: dict[str, int]
    expires_ms: int  # on the model's clock
    expires_at: datetime  # as the database said, to compare replays with
    end_reason: str | None = None


#: Keys drawn from a few, so that retries and conflicts happen; None: the client makes one up.
KEYS = st.none() | st.sampled_from(["k0", "k1", "k2", "k3"])
TTLS = st.integers(1, 3)
RARELY = st.sampled_from([False, False, False, True])
#: Semaphore 3 does not exist; counts are mostly within the capacities (1 to 4), sometimes past them.
WANTS = st.dictionaries(
    st.sampled_from([0, 1, 2, 0, 1, 2, 0, 1, 2, 3]), st.sampled_from([1, 1, 1, 2, 2, 3, 6]), min_size=1, max_size=3
)


class Refused(Exception):
    """What the model expects when an acquire finds no room: ``None``."""


class PermitsModel(RuleBasedStateMachine):
    """Each example gets semaphores and owners of its own, so examples never see each other's rows."""

    client: Any
    clock: OffsetClock | ServerOffsetClock | None
    #: what the examples did, across examples: the test checks that they reached every kind of answer
    seen: Counter[str]

    def __init__(self) -> None:
        super().__init__()
        ns = f"m{uuid.uuid4().hex[:10]}-"
        self.names = [f"{ns}a", f"{ns}b", f"{ns}c"]
        self.missing = f"{ns}missing"  # never created
        self.owners = [f"{ns}alice", f"{ns}bob"]
        self.ns = ns
        self.now_ms = 0
        self.sems: dict[str, ModelSemaphore] = {}
        self.leases: dict[tuple[str, str], ModelLease] = {}

    # ------------------------------------------------------------------------------------------ model

    def expired(self, lease: ModelLease) -> bool:
        """Held, but its TTL has passed (the database compares ``expires_at_ms <= now``)."""
        return lease.end_reason is None and self.now_ms >= lease.expires_ms

    def held(self) -> list[ModelLease]:
        return [lease for lease in self.leases.values() if lease.end_reason is None]

    def end(self, lease: ModelLease, reason: str) -> None:
        assert lease.end_reason is None
        lease.end_reason = reason
        for name, count in lease.counts.items():
            self.sems[name].used -= count

    def expect_acquire(self, owner: str, key: str, wants: dict[str, int]) -> ModelLease | type[Exception]:
        """What ``try_acquire`` must answer, following docs/guarantees.md and docs/api.md; applies any
        reclaim it does. A lease returned with no tokens is a new grant, to be filled in from the answer."""
        existing = self.leases.get((owner, key))
        if existing is not None:  # a retry: answered from the lease, whatever the room
            if existing.counts != wants:
                return IdempotencyConflict
            if existing.end_reason is not None or self.expired(existing):
                return LeaseLost
            return existing
        if all(n in self.sems and self.sems[n].used + c <= self.sems[n].capacity for n, c in wants.items()):
            return ModelLease(owner, key, dict(wants), {}, 0, datetime.min)
        if any(n not in self.sems for n in wants):
            return SemaphoreNotFound
        if any(c > self.sems[n].capacity for n, c in wants.items()):
            return CountExceedsCapacity
        # No room: expired leases of these semaphores are reclaimed (whole), then room is looked at again.
        for lease in self.held():
            if self.expired(lease) and set(lease.counts) & set(wants):
                self.end(lease, "expired")
                self.seen["acquire reclaimed an expired lease"] += 1
        if all(self.sems[n].used + c <= self.sems[n].capacity for n, c in wants.items()):
            return ModelLease(owner, key, dict(wants), {}, 0, datetime.min)
        return Refused

    def check_lease(self, lease: ModelLease) -> None:
        found = self.client.get_lease(lease.key, owner=lease.owner)
        assert (found.counts, found.tokens) == (lease.counts, lease.tokens)
        assert found.end_reason == lease.end_reason, (found, lease)
        if lease.end_reason is None:
            assert found.expires_at == lease.expires_at
            # The database's expires_in is the model's less the real time that passed (well under a UNIT).
            left = (lease.expires_ms - self.now_ms) / 1000
            assert left - UNIT / 2 < found.expires_in <= left, (found.expires_in, left)

    # ------------------------------------------------------------------------------------------ rules

    @initialize(capacities=st.lists(st.integers(1, 4), min_size=3, max_size=3))
    def create(self, capacities: list[int]) -> None:
        for name, capacity in zip(self.names, capacities, strict=True):
            sem = self.client.create_semaphore(name, capacity)
            assert (sem.capacity, sem.used, sem.last_token) == (capacity, 0, 0)
            self.sems[name] = ModelSemaphore(capacity)

    @rule(owner=st.integers(0, 1), key=KEYS, name=st.integers(0, 2), ttl=TTLS)
    def acquire_one(self, owner: int, key: str | None, name: int, ttl: int) -> None:
        self._acquire(self.owners[owner], key, {self.names[name]: 1}, ttl)

    @rule(owner=st.integers(0, 1), key=KEYS, wants=WANTS, ttl=TTLS)
    def acquire(self, owner: int, key: str | None, wants: dict[int, int], ttl: int) -> None:
        self._acquire(self.owners[owner], key, {self._name(i): c for i, c in wants.items()}, ttl)

    @rule(pick=st.integers(0, 100), same=st.booleans(), ttl=TTLS)
    def retry(self, pick: int, same: bool, ttl: int) -> None:
        """A retried acquire with a key already used: the same lease back, never a second grant."""
        if not self.leases:
            return
        lease = self._pick(pick)
        wants = dict(lease.counts)
        if not same:
            first = sorted(wants)[0]
            wants[first] += 1
        self._acquire(lease.owner, lease.key, wants, ttl)

    @precondition(lambda self: any(lease.end_reason for lease in self.leases.values()))
    @rule(pick=st.integers(0, 100))
    def retry_ended(self, pick: int) -> None:
        """A late retry of a lease that has ended: LeaseLost, never a second grant."""
        ended = [pair for pair, lease in self.leases.items() if lease.end_reason]
        lease = self.leases[ended[pick % len(ended)]]
        self._acquire(lease.owner, lease.key, dict(lease.counts), 1)

    def _acquire(self, owner: str, key: str | None, wants: dict[str, int], ttl: int) -> None:
        # Without a key the client makes one up: a new one, never used before.
        expected = self.expect_acquire(owner, key if key is not None else f"fresh-{uuid.uuid4().hex}", wants)
        if isinstance(expected, type):
            self.seen[f"acquire: {expected.__name__}"] += 1
            if expected is Refused:
                assert self.client.try_acquire(wants, key=key, owner=owner, ttl=ttl * UNIT) is None
            else:
                with pytest.raises(expected) as raised:
                    self.client.try_acquire(wants, key=key, owner=owner, ttl=ttl * UNIT)
                if expected is LeaseLost:
                    assert key is not None
                    lease = self.leases[(owner, key)]
                    assert raised.value.reason == (lease.end_reason or "expired")
            return
        got = self.client.try_acquire(wants, key=key, owner=owner, ttl=ttl * UNIT)
        assert got is not None
        assert (got.owner, got.counts) == (owner, wants) and got.key == (key or got.key)
        expected.key = got.key
        self.seen["acquire: replayed" if expected.tokens else "acquire: granted"] += 1
        if expected.tokens:  # a replay: the very same lease
            assert got.tokens == expected.tokens and got.expires_at == expected.expires_at and got.held
            return
        for name in sorted(wants):  # a grant: the next token of each semaphore
            sem = self.sems[name]
            sem.last_token += 1
            sem.used += wants[name]
            assert got.tokens[name] == sem.last_token
            assert sem.used <= sem.capacity
        expected.tokens = dict(got.tokens)
        expected.expires_ms = self.now_ms + round(ttl * UNIT * 1000)
        expected.expires_at = got.expires_at
        assert got.expires_in == ttl * UNIT
        self.leases[(owner, got.key)] = expected

    @rule(pick=st.integers(0, 100), unknown=RARELY)
    def release(self, pick: int, unknown: bool) -> None:
        if unknown or not self.leases:
            assert self.client.release(f"never-{uuid.uuid4().hex}", owner=self.owners[0]) == ReleaseOutcome.NOT_FOUND
            return
        lease = self._pick(pick)
        if lease.end_reason is None and not self.expired(lease):
            self.end(lease, "released")
            expected = ReleaseOutcome.RELEASED
        elif lease.end_reason is None:  # its TTL passed: the release ends it as expired
            self.end(lease, "expired")
            expected = ReleaseOutcome.LOST
        else:
            expected = ReleaseOutcome.ALREADY_RELEASED if lease.end_reason == "released" else ReleaseOutcome.LOST
        assert self.client.release(lease.key, owner=lease.owner) == expected
        self.seen[f"release: {expected}"] += 1
        self.check_lease(lease)

    @rule(pick=st.integers(0, 100), ttl=TTLS, unknown=RARELY)
    def extend(self, pick: int, ttl: int, unknown: bool) -> None:
        if unknown or not self.leases:
            with pytest.raises(LeaseNotFound):
                self.client.extend(f"never-{uuid.uuid4().hex}", ttl * UNIT, owner=self.owners[1])
            return
        lease = self._pick(pick)
        if lease.end_reason is not None or self.expired(lease):
            with pytest.raises(LeaseLost) as raised:
                self.client.extend(lease.key, ttl * UNIT, owner=lease.owner)
            assert raised.value.reason == (lease.end_reason or "expired")
            self.seen["extend: LeaseLost"] += 1
        else:
            got = self.client.extend(lease.key, ttl * UNIT, owner=lease.owner)
            assert got.tokens == lease.tokens and got.held
            lease.expires_ms = self.now_ms + round(ttl * UNIT * 1000)
            lease.expires_at = got.expires_at
        self.check_lease(lease)

    @precondition(lambda self: self.clock is not None)
    @rule(units=st.integers(1, 3))
    def advance(self, units: int) -> None:
        assert self.clock is not None
        self.clock.advance(units * UNIT)
        self.now_ms += round(units * UNIT * 1000)

    @rule()
    def sweep(self) -> None:
        result = self.client.sweep()
        ours = {(owner, key) for owner, key in result.keys if key and owner in self.owners}
        expected = {(lease.owner, lease.key) for lease in self.held() if self.expired(lease)}
        assert ours == expected
        for pair in expected:
            self.end(self.leases[pair], "swept")
            self.seen["sweep ended a lease"] += 1

    @rule(which=st.integers(0, 2), change=st.integers(-2, 2))
    def set_capacity(self, which: int, change: int) -> None:
        """Lowering a capacity below use revokes nothing: no new grant until use drops below it."""
        name = self.names[which]
        capacity = max(1, self.sems[name].used + change)
        change = self.client.set_capacity(name, capacity, reason="model")
        assert (change.old_capacity, change.new_capacity) == (self.sems[name].capacity, capacity)
        self.sems[name].capacity = capacity
        if capacity < self.sems[name].used:
            self.seen["capacity lowered below use"] += 1

    @precondition(lambda self: any(sem.used >= 2 for sem in self.sems.values()))
    @rule(pick=st.integers(0, 2))
    def shrink_below_use(self, pick: int) -> None:
        busy = [name for name in self.names if self.sems[name].used >= 2]
        name = busy[pick % len(busy)]
        self.set_capacity(self.names.index(name), -1)

    @rule(call=st.sampled_from(["count-0", "ttl-0", "key-empty", "capacity-0", "name-nul", "extend-ttl-nan"]))
    def bad_input(self, call: str) -> None:
        """Refused with InvalidArgument; the invariants then check that nothing changed."""
        name = self.names[0]
        attempts = {
            "count-0": lambda: self.client.try_acquire({name: 0}, owner=self.owners[0]),
            "ttl-0": lambda: self.client.try_acquire(name, owner=self.owners[0], ttl=0),
            "key-empty": lambda: self.client.try_acquire(name, key="", owner=self.owners[0]),
            "capacity-0": lambda: self.client.set_capacity(name, 0, reason="model"),
            "name-nul": lambda: self.client.try_acquire({name + "\x00": 1}, owner=self.owners[0]),
            "extend-ttl-nan": lambda: self.client.extend("k0", float("nan"), owner=self.owners[0]),
        }
        with pytest.raises(InvalidArgument):
            attempts[call]()

    # ------------------------------------------------------------------------------------- invariants

    @invariant()
    def semaphores_match(self) -> None:
        if not self.sems:
            return
        found = {s.name: (s.capacity, s.used, s.last_token) for s in self.client.list_semaphores(self.ns)}
        assert found == {n: (s.capacity, s.used, s.last_token) for n, s in self.sems.items()}
        for name in self.names:
            holders = [(h.owner, h.key, h.count, h.token) for h in self.client.holders(name)]
            expected = sorted(
                (
                    (lease.owner, lease.key, lease.counts[name], lease.tokens[name])
                    for lease in self.held()
                    if name in lease.counts
                ),
                key=lambda h: h[3],
            )
            assert holders == expected
            # The permits in use are never more than the capacity was when they were granted, and never
            # more than the sum of what the holders hold.
            assert self.sems[name].used == sum(h[2] for h in holders)

    def teardown(self) -> None:
        try:
            if self.sems:
                for lease in self.leases.values():
                    self.check_lease(lease)
                ours = [d for d in self.client.reconcile() if d.name.startswith(self.ns)]
                assert ours == []
                for lease in self.held():  # leave no lease held on a shared database
                    self.client.release(lease.key, owner=lease.owner)
        finally:
            super().teardown()

    # ------------------------------------------------------------------------------------------ helpers

    def _name(self, index: int) -> str:
        return self.missing if index == 3 else self.names[index]

    def _pick(self, pick: int) -> ModelLease:
        # In the order of their grants, not sorted: a lease taken without a key has a random one, and an
        # order that depends on it would make the same example pick another lease when hypothesis replays it.
        keys = list(self.leases)
        return self.leases[keys[pick % len(keys)]]


#: What every run must have seen at least once, or its examples were too tame to mean much.
REACHED = {
    "acquire: granted",
    "acquire: replayed",
    "acquire: Refused",
    "acquire: IdempotencyConflict",
    "acquire: LeaseLost",
    "acquire: CountExceedsCapacity",
    "acquire: SemaphoreNotFound",
    "release: released",
    "release: already_released",
}
#: And what the longer run with a moving clock must have seen as well.
REACHED_WITH_CLOCK = {
    "acquire reclaimed an expired lease",
    "sweep ended a lease",
    "release: lost",
    "extend: LeaseLost",
    "capacity lowered below use",
}


def _run(client: Any, clock: OffsetClock | ServerOffsetClock | None, examples: int, steps: int) -> Counter[str]:
    seen: Counter[str] = Counter()
    machine = type("Model", (PermitsModel,), {"client": client, "clock": clock, "seen": seen})
    run_state_machine_as_test(machine, settings=_settings(examples, steps))
    missing = (REACHED | (REACHED_WITH_CLOCK if clock is not None else set())) - set(seen)
    assert not missing, f"no example reached {sorted(missing)}: {dict(seen)}"
    return seen


@pytest.mark.slow
def test_model_on_sqlite_with_a_moving_clock(tmp_path: Path) -> None:
    """The full model, time included, on a SQLite file of its own (a sweep on a clock hours ahead would
    end other tests' leases on a shared one)."""
    with offset_clock() as clock:
        client = permits.connect(f"sqlite:///{tmp_path / 'model.db'}")
    try:
        _run(client, clock, examples=60, steps=40)
    finally:
        client.close()


#: The MySQL-family dialects that a mysql:// URL may turn out to need, by the name of the test's variant:
#: each is run on MariaDB, whose engine takes their statements (tests/scaleout run them on their own servers).
MYSQL_FAMILY = {
    "as_mariadb105": MariaDB105,
    "as_mysql8": MySQL,
    "as_galera": MariaDBCluster,
    "as_mysql8_cluster": MySQLCluster,
}


@pytest.mark.parametrize(
    "server",
    [
        "mysql",
        "postgresql",
        "postgresql-functions",
        "mysql-service",
        "postgresql-service",
        *(f"mysql-{variant}" for variant in MYSQL_FAMILY),
    ],
)
@pytest.mark.slow
def test_model_on_a_server_with_a_moving_clock(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full model, time included, on MariaDB and PostgreSQL: each runs its own statements for sweeps,
    reclaims and extends, and its own reading of the clock. On a database of the test's own, for the same
    reason as SQLite's file.
    - ``-functions``: PostgreSQL as a client behind a transaction pooler sees it, whose grant and release
      are calls of server functions made from those statements (dialects/pg_functions.py); the URL's
      parameter does that without a pooler in between.
    - ``-service``: through a ``permits serve`` process that follows the test's clock (tests/_clocked.py),
      with its background sweeps off, as the model sweeps when it chooses.
    - ``-as_...``: the statements that MySQL 8 (no INSERT ... RETURNING) and the multi-primary clusters
      (a statement per request) write their own way, on MariaDB: the store is told it reached such a
      server."""
    backend, _, variant = server.partition("-")
    if variant in MYSQL_FAMILY:
        chosen = MYSQL_FAMILY[variant]
        monkeypatch.setattr(
            "permits._sync.store.mysql_family_dialect", lambda is_mariadb, multi_primary, version=None, **_: chosen()
        )
    with own_database(backend, "permits_clock") as url:
        if variant == "functions":
            count_function_calls(url)
        with contextlib.ExitStack() as stack:
            clock = stack.enter_context(server_offset_clock(url))
            if variant == "service":
                off = {"PERMITS_MAINTENANCE__ENABLED": "false"}
                with permits.connect(url, auto_upgrade=True) as direct:  # the schema, made directly
                    direct.list_semaphores()
                service = stack.enter_context(running(url, env=off, module="tests._clocked"))
                client = stack.enter_context(permits.connect(service.url))
            else:
                pooler = "?pooler=transaction" if variant == "functions" else ""
                client = stack.enter_context(permits.connect(url + pooler, auto_upgrade=True))
            # 60 examples on every variant. (40 through the service, each step of which is a request to another
            # process, reached every kind of answer on an idle machine, but not "extend: LeaseLost" on MariaDB
            # under the parallel test run's load.)
            _run(client, clock, examples=60, steps=40)
            if variant in MYSQL_FAMILY:
                assert type(client._store._dialect) is MYSQL_FAMILY[variant]
        if variant == "functions":  # made (with the moved clock in them) and called; counted as sessions end
            assert called_functions(url) == {"acquire_one", "acquire_many", "release"}


@pytest.mark.parametrize("flavour", ["sync"])  # the asyncio client runs the same store code; this is slow enough
def test_model_without_time(make_client: Any) -> None:
    """Every backend, directly and through a service: the same machine, with a clock that does not move."""
    _run(make_client(), None, examples=15, steps=25)
