"""The checker of fault runs: reads a merged history (``tests/faults/history.py``) and the database's state
read after the run (``Final``), and lists every violation of the properties permits promises.

Properties (each a function below, each returning a list of human-readable violations):

- ``capacity``: at no instant do *definitely held* leases exceed a semaphore's capacity. A lease is
  definitely held from the end of its first ``ok`` acquire to the start of its first release (of any
  outcome), capped at its expiry: its first acquire attempt's start plus its TTL as the database gave it
  (the database stamped the grant after that start, so it expires no earlier). Unknown outcomes are only
  possibly held and never count.
- ``capacity_on_the_database_clock``: the same, on the database's own clock, for every lease the database
  holds under a key a worker tried (acknowledged or not: an acquire that timed out may have been granted):
  a lease counts from its ``acquired_at`` to its ``ended_at`` (or the end of the run), as the semaphore's
  count of permits in use holds it. Sound because a grant reads the clock after it has locked the
  semaphore's row, so after the commit of the release or reclaim it took the room from, which read the
  clock before that commit (docs/guarantees.md, section 3).
- ``ended_for_expiry``: a lease ended because it expired (``expired``, ``swept``) ended no earlier than its
  expiry, on the database's clock.
- ``token_order``: for grants of one semaphore ordered in real time (A's acquire returned before B's first
  attempt started), A's token is lower than B's; no token is handed to two leases.
- ``idempotency``: every ``ok`` acquire of one (owner, key) got the same token, which is the one the
  database keeps for that key; an acquire that definitely failed (no room) was never granted.
- ``register``: the fenced register's log, in commit order (its version), never goes back to a lower
  token; every acknowledged write is in it with its version and token, no refused write is; and for
  acknowledged writes ordered in real time, the later one has the higher version and no lower token.
- ``durability``: every acknowledged grant exists after the run (after any database restart) with its
  token; every acknowledged release left its lease released; a release told ``lost`` or ``not_found``
  was right.
- ``killed_return``: the leases of a SIGKILLed holder end (swept, or reclaimed by an acquire), on the
  database's clock, within its TTL plus the sweep interval plus slack; none is left unended at the end.
- ``reconcile``: ``client.reconcile()`` reports no drift at the end.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from tests.faults.history import FAIL, OK, UNKNOWN, History, Op

T = TypeVar("T")
#: the database stamps lease times in milliseconds; never count a lease as held this close to its expiry
EXPIRY_EPSILON = 0.01


@dataclass
class Final:
    """What the harness read from the database after the run."""

    t: float  # time.monotonic() of the read
    leases: dict[tuple[str, str], dict[str, Any]]  # (owner, key) -> lease.to_dict() of every key tried
    register: dict[str, list[tuple[int, int, str]]]  # resource -> [(version, token, wid)] from the log
    drift: list[Any]
    capacity: dict[str, int]
    sweep_interval: float
    slack: float = 10.0


@dataclass
class Report:
    violations: list[str]
    stats: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"{len(self.violations)} violation(s); {self.stats}"]
        lines += [f"  - {v}" for v in self.violations[:40]]
        return "\n".join(lines)


@dataclass
class _Grant:
    """All the attempts of one (owner, key) acquire."""

    owner: str
    key: str
    sem: str
    attempts: list[Op]
    releases: list[Op] = field(default_factory=list)

    @property
    def oks(self) -> list[Op]:
        return [a for a in self.attempts if a.outcome == OK]

    @property
    def first_start(self) -> float:
        return min(a.t0 for a in self.attempts)

    @property
    def granted_by(self) -> float:
        """When its grant was definitely done: the end of its first ok attempt."""
        return min(a.t1 for a in self.oks)

    @property
    def token(self) -> int:
        return int(self.oks[0]["token"])

    @property
    def held_until(self) -> float:
        """Until when it was definitely held: its first release's start, capped at its expiry."""
        expiry = self.first_start + float(self.oks[0]["ttl_db"]) - EXPIRY_EPSILON
        return min([expiry, *(r.t0 for r in self.releases)])


def _grants(history: History) -> dict[tuple[str, str], _Grant]:
    grants: dict[tuple[str, str], _Grant] = {}
    for op in history.of("acquire"):
        ref = (op["owner"], op["key"])
        grants.setdefault(ref, _Grant(op["owner"], op["key"], op["sem"], [])).attempts.append(op)
    for op in history.of("release"):
        grant = grants.get((op["owner"], op["key"]))
        if grant is not None:
            grant.releases.append(op)
    return grants


def _highest_before(
    items: list[T], start: Callable[[T], float], end: Callable[[T], float], rank: Callable[[T], int]
) -> Iterator[tuple[T | None, T]]:
    """Pairs each item with the highest-ranked item that had ended before it started (None if none had)."""
    by_end = sorted(items, key=end)
    best: T | None = None
    i = 0
    for item in sorted(items, key=start):
        while i < len(by_end) and end(by_end[i]) < start(item):
            if best is None or rank(by_end[i]) > rank(best):
                best = by_end[i]
            i += 1
        yield best, item


def _overruns(spans: list[tuple[float, float, str]], limit: int) -> Iterator[tuple[float, list[str]]]:
    """Each instant at which more than ``limit`` of the [start, end) ``spans`` (start, end, key) overlap,
    with the keys held then; ends sort before starts at the same instant. A span that ends where it starts
    (a grant and its release stamped in the same millisecond) holds nothing."""
    spans = [span for span in spans if span[1] > span[0]]
    points = sorted([(s, 1, k) for s, _, k in spans] + [(e, -1, k) for _, e, k in spans], key=lambda p: p[:2])
    held: set[str] = set()
    for t, delta, key in points:
        if delta < 0:
            held.discard(key)
            continue
        held.add(key)
        if len(held) > limit:
            yield t, sorted(held)


def capacity(history: History, limits: dict[str, int]) -> list[str]:
    by_sem: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for grant in _grants(history).values():
        if grant.oks and grant.held_until > grant.granted_by:
            by_sem[grant.sem].append((grant.granted_by, grant.held_until, grant.key))
    return [
        f"capacity: {len(held)} leases definitely held on {sem} (capacity {limits[sem]}) at t={t:.3f}: {held}"
        for sem, spans in by_sem.items()
        for t, held in _overruns(spans, limits[sem])
    ]


def capacity_on_the_database_clock(final: Final) -> list[str]:
    by_sem: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for lease in final.leases.values():
        start = datetime.fromisoformat(lease["acquired_at"]).timestamp()
        end = math.inf if lease["ended_at"] is None else datetime.fromisoformat(lease["ended_at"]).timestamp()
        for sem, count in lease["counts"].items():
            by_sem[sem] += [(start, end, f"{lease['key']}#{i}") for i in range(int(count))]
    return [
        f"capacity_on_the_database_clock: {len(held)} permits of {sem} in use (capacity"
        f" {final.capacity[sem]}) at {datetime.fromtimestamp(t, UTC).isoformat()}: {held}"
        for sem, spans in by_sem.items()
        for t, held in _overruns(spans, final.capacity[sem])
    ]


def ended_for_expiry(final: Final) -> list[str]:
    return [
        f"ended_for_expiry: {lease['key']} was {lease['end_reason']} at {lease['ended_at']}, before its expiry"
        f" {lease['expires_at']}"
        for lease in final.leases.values()
        if lease["end_reason"] in ("expired", "swept") and _seconds(lease["expires_at"], lease["ended_at"]) < 0
    ]


def token_order(history: History) -> list[str]:
    by_sem: dict[str, list[_Grant]] = defaultdict(list)
    for grant in _grants(history).values():
        if grant.oks:
            by_sem[grant.sem].append(grant)
    violations = []
    for sem, grants in by_sem.items():
        owners: dict[int, _Grant] = {}
        for g in grants:
            other = owners.setdefault(g.token, g)
            if other is not g:
                violations.append(f"token_order: token {g.token} of {sem} granted to {other.key} and to {g.key}")
        pairs = _highest_before(grants, lambda g: g.first_start, lambda g: g.granted_by, lambda g: g.token)
        for best, g in pairs:
            if best is not None and best.token >= g.token:
                violations.append(
                    f"token_order: {best.key} (token {best.token}) was granted before {g.key} was asked for, but"
                    f" {g.key} got the lower or equal token {g.token} on {sem}"
                )
    return violations


def idempotency(history: History, final: Final) -> list[str]:
    violations = []
    for ref, grant in _grants(history).items():
        stored = final.leases.get(ref)
        tokens = {int(a["token"]) for a in grant.oks}
        if len(tokens) > 1:
            violations.append(f"idempotency: key {grant.key} was granted {len(tokens)} times: tokens {sorted(tokens)}")
        if (
            stored is not None
            and grant.attempts
            and all(a.outcome == FAIL and a["why"] == "no_room" for a in grant.attempts)
        ):
            violations.append(f"idempotency: every acquire of {grant.key} failed for no room, yet it was granted")
    per_sem: dict[tuple[str, int], list[str]] = defaultdict(list)
    for (_, key), lease in final.leases.items():
        for sem, token in lease["tokens"].items():
            per_sem[(sem, int(token))].append(key)
    for (sem, token), keys in per_sem.items():
        if len(keys) > 1:
            violations.append(f"idempotency: token {token} of {sem} is stored for {len(keys)} leases: {keys}")
    return violations


def register(history: History, final: Final) -> list[str]:
    violations = []
    writes = history.of("write")
    for resource, log in final.register.items():
        rows = sorted(log)
        if [v for v, _, _ in rows] != list(range(1, len(rows) + 1)):
            violations.append(f"register: the versions of {resource} have gaps or repeats")
        for (v1, t1, w1), (v2, t2, w2) in itertools.pairwise(rows):
            if t2 < t1:
                violations.append(
                    f"register: {resource} accepted token {t2} ({w2}, version {v2}) after token {t1} ({w1},"
                    f" version {v1})"
                )
        by_wid = {w: (v, t) for v, t, w in rows}
        mine = [w for w in writes if w["resource"] == resource]
        for w in mine:
            found = by_wid.get(w["wid"])
            if w.outcome == OK and found != (w["version"], w["token"]):
                violations.append(
                    f"register: acknowledged write {w['wid']} (version {w['version']}, token {w['token']}) is"
                    f" logged as {found}"
                )
            if w.outcome == FAIL and found is not None:
                violations.append(f"register: refused write {w['wid']} (token {w['token']}) is in the log")
        acked = [w for w in mine if w.outcome == OK]
        for latest, b in _highest_before(acked, lambda w: w.t0, lambda w: w.t1, lambda w: w["version"]):
            if latest is not None and (latest["version"] >= b["version"] or latest["token"] > b["token"]):
                violations.append(
                    f"register: write {b['wid']} (version {b['version']}, token {b['token']}) started after"
                    f" {latest['wid']} (version {latest['version']}, token {latest['token']}) was acknowledged"
                )
    return violations


def durability(history: History, final: Final) -> list[str]:
    violations = []
    for ref, grant in _grants(history).items():
        stored = final.leases.get(ref)
        if grant.oks and stored is None:
            violations.append(f"durability: acknowledged grant {grant.key} (token {grant.token}) is gone")
            continue
        if grant.oks and stored is not None and int(stored["tokens"][grant.sem]) != grant.token:
            violations.append(
                f"durability: grant {grant.key} was acknowledged with token {grant.token}, the database has"
                f" {stored['tokens'][grant.sem]}"
            )
        for rel in grant.releases:
            if rel.outcome == OK and (stored is None or stored["end_reason"] != "released"):
                state = "gone" if stored is None else f"held={stored['held']}, end_reason={stored['end_reason']}"
                violations.append(f"durability: acknowledged release of {grant.key} is lost ({state})")
            if rel["result"] == "lost" and stored is not None and stored["end_reason"] in (None, "released"):
                violations.append(
                    f"durability: release of {grant.key} said lost, the lease is {stored['end_reason'] or 'held'}"
                )
            if rel["result"] == "not_found" and stored is not None:
                violations.append(f"durability: release of {grant.key} said not_found, but the lease exists")
    return violations


def killed_return(history: History, final: Final) -> list[str]:
    killed = history.killed_at()
    violations = []
    bound = final.sweep_interval + final.slack
    for grant in _grants(history).values():
        if grant.attempts[0].proc not in killed or any(r.outcome == OK for r in grant.releases):
            continue
        stored = final.leases.get((grant.owner, grant.key))
        if stored is None or stored["end_reason"] == "released":
            continue  # never granted, or its release got through before the kill
        if stored["end_reason"] is None:  # not ended (held, or expired and not reclaimed yet)
            ttl = _seconds(stored["acquired_at"], stored["expires_at"])
            if final.t > grant.first_start + ttl + bound:
                violations.append(f"killed_return: {grant.key} of a killed holder has not ended by the end")
            continue
        late = _seconds(stored["expires_at"], stored["ended_at"])
        if late > bound:
            violations.append(
                f"killed_return: {grant.key} of a killed holder ended {late:.1f} s after its expiry (bound"
                f" {bound:.1f} s: sweep interval + slack)"
            )
    return violations


def reconcile(final: Final) -> list[str]:
    return [f"reconcile: drift {d}" for d in final.drift]


def _seconds(a: str, b: str) -> float:
    return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()


def check(history: History, final: Final) -> Report:
    violations = [
        *capacity(history, final.capacity),
        *capacity_on_the_database_clock(final),
        *ended_for_expiry(final),
        *token_order(history),
        *idempotency(history, final),
        *register(history, final),
        *durability(history, final),
        *killed_return(history, final),
        *reconcile(final),
    ]
    stats: dict[str, int] = defaultdict(int)
    for op in history.ops:
        stats[f"{op.op}_{op.outcome}"] += 1
        if op.outcome == UNKNOWN and math.isinf(op.t1):
            stats["never_completed"] += 1
    stats["kills"] = len(history.killed_at())
    for lease in final.leases.values():
        stats[f"ended_{lease['end_reason']}"] += 1  # ended_None: held at the end
    return Report(violations, dict(sorted(stats.items())))
