"""What the dashboard reads and records, as flows (see ``flows``) and pure functions over their rows.

Nothing here runs on the acquire or release path. The short-term history has two sources:
- samples of every semaphore, taken every step by one elected service instance (``take_sample``): use,
  capacity, waiters, the fencing token (its rise is the number of grants) and the hold times of the
  leases that ended since the sample before;
- what each service instance saw (``record_instance``): refusals, timeouts, requests waiting and how
  long granted acquires waited, which only the instance that answered knows.
Both live in the database, so any instance can draw the charts and a restart blanks nothing.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from permits._core.flows import DuplicateKey, Flow, Restart, Stmt, Then

#: Upper bounds (ms) of the wait-time histogram's buckets; a last bucket takes everything above.
WAIT_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000)
#: At most this many ended leases are read per sample for hold times (the count is exact up to it).
MAX_ENDED_PER_SAMPLE = 20_000
MINUTE_MS = 60_000


# ----------------------------------------------------------------------------------------- histograms


def wait_histogram() -> list[int]:
    return [0] * (len(WAIT_BUCKETS_MS) + 1)


def histogram_add(hist: list[int], value_ms: float) -> None:
    hist[bisect.bisect_left(WAIT_BUCKETS_MS, value_ms)] += 1


def histogram_text(hist: Sequence[int]) -> str:
    return ",".join(str(n) for n in hist)


def histogram_parse(text: str) -> list[int]:
    """A stored histogram; one written by another version with other buckets counts as empty."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        return wait_histogram()
    return counts if len(counts) == len(WAIT_BUCKETS_MS) + 1 else wait_histogram()


def histogram_percentile(hist: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0..1), interpolated inside its bucket; the open last bucket answers its lower
    bound. None for an empty histogram."""
    total = sum(hist)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(hist):
        if n and seen + n >= rank:
            lower = 0.0 if i == 0 else float(WAIT_BUCKETS_MS[i - 1])
            if i == len(WAIT_BUCKETS_MS):
                return lower
            upper = float(WAIT_BUCKETS_MS[i])
            return lower + (upper - lower) * max(0.0, rank - seen) / n
        seen += n
    return float(WAIT_BUCKETS_MS[-1])  # pragma: no cover - the loop always reaches the rank


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile of exact values; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])


# ------------------------------------------------------------------------------------------- recording


def take_sample(step_ms: int, keep_ms: int) -> Flow[int]:
    """Sample every live semaphore into ``permits_stat`` at the step's start, unless this step has been
    sampled already, and prune old samples. Returns the number of rows written."""
    sems = yield Stmt("STAT_SEMS")
    now_ms = int(sems.rows[0][5]) if sems.rows else int((yield Stmt("NOW_MS")).rows[0][0])
    bucket_ms = now_ms - now_ms % step_ms
    last = (yield Stmt("STAT_LAST")).rows[0][0]
    if last is not None and int(last) >= bucket_ms:
        return 0  # another instance sampled this step
    # Leases that ended after the previous sample, and up to this one: each counts in one sample only.
    since_ms = int(last) if last is not None else bucket_ms - step_ms
    ended = yield Stmt("STAT_ENDED", {"since_ms": since_ms, "until_ms": bucket_ms, "limit": MAX_ENDED_PER_SAMPLE})
    held: dict[str, list[float]] = defaultdict(list)
    for name, held_ms in ended.rows:
        held[str(name)].append(float(held_ms))
    rows = []
    for name, capacity, used, last_token, queued, *_ in sems.rows:
        times = held.get(str(name), [])
        p50, p99 = percentile(times, 0.5), percentile(times, 0.99)
        rows.append(
            {
                "name": str(name),
                "bucket_ms": bucket_ms,
                "capacity": int(capacity),
                "used": int(used),
                "waiting": int(queued),
                "last_token": int(last_token),
                "ended": len(times),
                "hold_p50_ms": None if p50 is None else round(p50),
                "hold_p99_ms": None if p99 is None else round(p99),
            }
        )
    if rows:
        try:
            yield Stmt("STAT_INSERT", rows)
        except DuplicateKey:
            # Two instances sampled the same step at once: theirs stands.
            raise Restart(_nothing) from None
    yield Stmt("STAT_PRUNE", {"keep_ms": keep_ms})
    yield Stmt("ISTAT_PRUNE", {"keep_ms": keep_ms})
    return len(rows)


def prune_admin_log(keep_ms: int) -> Flow[int]:
    done = yield Stmt("ADMIN_LOG_PRUNE", {"keep_ms": keep_ms})
    return done.rowcount


def clock() -> Flow[int]:
    """The database's clock, in milliseconds."""
    found = yield Stmt("NOW_MS")
    return int(found.rows[0][0])


def _nothing() -> Flow[int]:
    yield Stmt("NOW_MS")
    return 0


@dataclass
class Seen:
    """What one instance saw of one semaphore during a step."""

    granted: int = 0
    refused: int = 0
    timeouts: int = 0
    waiting: int = 0
    wait_hist: list[int] = field(default_factory=wait_histogram)

    def merge(self, other: Seen) -> None:
        self.granted += other.granted
        self.refused += other.refused
        self.timeouts += other.timeouts
        self.waiting = max(self.waiting, other.waiting)
        self.wait_hist = [a + b for a, b in zip(self.wait_hist, other.wait_hist, strict=True)]


#: The row an instance writes every step even when idle: its heartbeat, so the page can count instances.
ALL_SEMAPHORES = ""


def record_instance(instance: str, seen: Mapping[str, Seen]) -> Flow[None]:
    """Write one step of an instance's counts, stamped with the database's clock."""
    now_ms = int((yield Stmt("NOW_MS")).rows[0][0])
    rows = [
        {
            "instance": instance,
            "name": name,
            "bucket_ms": now_ms,
            "granted": s.granted,
            "refused": s.refused,
            "timeouts": s.timeouts,
            "waiting": s.waiting,
            "wait_hist": histogram_text(s.wait_hist),
        }
        for name, s in seen.items()
    ]
    if rows:
        yield Stmt("ISTAT_INSERT", rows)


def log_admin(
    actor: str,
    action: str,
    name: str | None,
    reason: str,
    detail: str | None = None,
    lease_owner: str | None = None,
    lease_key: str | None = None,
) -> Stmt:
    """The admin log's row for an action, to be sent in the action's own transaction (see ``audited``)."""
    return Stmt(
        "ADMIN_LOG_INSERT",
        {
            "actor": actor,
            "action": action,
            "name": name,
            "lease_owner": lease_owner,
            "lease_key": lease_key,
            "reason": reason,
            "detail": None if detail is None else detail[:1000],
        },
    )


def audited(
    action: Flow[Any], entry: Stmt | Callable[[Any], Stmt | None], restart_does_nothing: bool = False
) -> Flow[Any]:
    """Run an admin action's flow, then write its log entry (or the entry made from the action's answer;
    none when that says nothing was done) in the same transaction: the action and its record commit
    together or not at all. An action that goes on in another transaction (``Restart``, ``Then``) takes its
    record along, to the transaction that finishes it; unless ``restart_does_nothing`` says that its
    ``Restart`` only goes to find that there is nothing to do (a create of a semaphore that is there
    already), and then it is not recorded: the log holds what was done."""
    try:
        done = yield from action
    except Restart as restart:
        if restart_does_nothing:
            raise
        goes_on = restart.flow
        raise Restart(lambda: audited(goes_on(), entry), restart.readonly) from None
    if isinstance(done, Then):
        then = done
        return Then(lambda: audited(then.flow(), entry))
    record = entry if isinstance(entry, Stmt) else entry(done)
    if record is not None:
        yield record
    return done


# --------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Snapshot:
    """The rows the overview is drawn from."""

    semaphores: list[tuple[Any, ...]]
    minutes: list[tuple[Any, ...]]
    instances: list[tuple[Any, ...]]


def overview_rows(window_ms: int, recent_ms: int) -> Flow[Snapshot]:
    sems = yield Stmt("STAT_SEMS")
    minutes = yield Stmt("STAT_MINUTES", {"window_ms": window_ms})
    instances = yield Stmt("ISTAT_RECENT", {"window_ms": recent_ms})
    return Snapshot(list(sems.rows), list(minutes.rows), list(instances.rows))


def semaphore_series(name: str, window_ms: int) -> Flow[tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]]:
    samples = yield Stmt("STAT_SERIES", {"name": name, "window_ms": window_ms})
    seen = yield Stmt("ISTAT_SERIES", {"name": name, "window_ms": window_ms})
    return list(samples.rows), list(seen.rows)


def endings(name: str, limit: int) -> Flow[list[tuple[Any, ...]]]:
    found = yield Stmt("ENDINGS", {"name": name, "limit": limit})
    return list(found.rows)


def admin_log(name: str | None, limit: int) -> Flow[list[tuple[Any, ...]]]:
    if name is None:
        found = yield Stmt("ADMIN_LOG_LIST", {"limit": limit})
    else:
        found = yield Stmt("ADMIN_LOG_FOR", {"name": name, "limit": limit})
    return list(found.rows)


# ------------------------------------------------------------------------------- assembling (pure)


def instances_up(rows: Iterable[Sequence[Any]], now_ms: int, fresh_ms: int) -> int:
    """Instances whose heartbeat row is at most ``fresh_ms`` old."""
    return len({r[0] for r in rows if r[1] == ALL_SEMAPHORES and now_ms - int(r[2]) <= fresh_ms})


def waiting_now(rows: Iterable[Sequence[Any]], now_ms: int, fresh_ms: int) -> dict[str, int]:
    """Requests waiting per semaphore: each instance's latest fresh report, summed over instances."""
    latest: dict[tuple[str, str], tuple[int, int]] = {}
    for instance, name, bucket_ms, *_rest in rows:
        if name == ALL_SEMAPHORES or now_ms - int(bucket_ms) > fresh_ms:
            continue
        key = (str(instance), str(name))
        if key not in latest or int(bucket_ms) > latest[key][0]:
            latest[key] = (int(bucket_ms), int(_rest[3]))
    totals: dict[str, int] = defaultdict(int)
    for (_, name), (_, waiting) in latest.items():
        totals[name] += waiting
    return dict(totals)


def per_minute_rates(rows: Iterable[Sequence[Any]], now_ms: int, window_ms: int) -> dict[str, tuple[float, float]]:
    """Refusals and timeouts per minute over the last ``window_ms``, per semaphore."""
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for _instance, name, bucket_ms, _granted, refused, timeouts, *_ in rows:
        if name != ALL_SEMAPHORES and now_ms - int(bucket_ms) <= window_ms:
            sums[str(name)][0] += int(refused)
            sums[str(name)][1] += int(timeouts)
    minutes = window_ms / MINUTE_MS
    return {name: (r / minutes, t / minutes) for name, (r, t) in sums.items()}


def utilisation_by_minute(rows: Iterable[Sequence[Any]], now_ms: int, minutes: int) -> dict[str, list[float | None]]:
    """Each semaphore's mean utilisation per minute for the last ``minutes`` minutes, oldest first."""
    first = (now_ms - now_ms % MINUTE_MS) - (minutes - 1) * MINUTE_MS
    series: dict[str, list[float | None]] = defaultdict(lambda: [None] * minutes)
    for name, minute_ms, util in rows:
        slot = (int(minute_ms) - first) // MINUTE_MS
        if 0 <= slot < minutes and util is not None:
            series[str(name)][slot] = round(float(util), 4)
    return dict(series)


def minute_points(
    samples: Sequence[Sequence[Any]], seen: Sequence[Sequence[Any]], now_ms: int, minutes: int
) -> list[dict[str, Any]]:
    """One point per minute for one semaphore's charts, oldest first (None where nothing was recorded)."""
    first = (now_ms - now_ms % MINUTE_MS) - (minutes - 1) * MINUTE_MS
    slots: list[dict[str, Any]] = [
        {
            "t_ms": first + i * MINUTE_MS,
            "utils": [],
            "capacity": None,
            "used_max": None,
            "tokens": [],
            "ended": 0,
            "holds50": [],
            "holds99": [],
            "granted": 0,
            "refused": 0,
            "timeouts": 0,
            "hist": wait_histogram(),
            "seen": False,
        }
        for i in range(minutes)
    ]
    for bucket_ms, capacity, used, _waiting, last_token, ended, p50, p99 in samples:
        slot = (int(bucket_ms) - first) // MINUTE_MS
        if not 0 <= slot < minutes:
            continue
        s = slots[slot]
        if int(capacity) > 0:
            s["utils"].append(int(used) / int(capacity))
        s["capacity"] = int(capacity)
        s["used_max"] = max(int(used), s["used_max"] or 0)
        s["tokens"].append(int(last_token))
        s["ended"] += int(ended)
        if p50 is not None:
            s["holds50"].append(float(p50))
            s["holds99"].append(float(p99))
    for _instance, _name, bucket_ms, granted, refused, timeouts, _waiting, hist, *_ in seen:
        slot = (int(bucket_ms) - first) // MINUTE_MS
        if not 0 <= slot < minutes:
            continue
        s = slots[slot]
        s["seen"] = True
        s["granted"] += int(granted)
        s["refused"] += int(refused)
        s["timeouts"] += int(timeouts)
        s["hist"] = [a + b for a, b in zip(s["hist"], histogram_parse(str(hist)), strict=True)]
    points = []
    previous_token: int | None = None
    for s in slots:
        grants = None
        if s["tokens"]:
            # Grants in a minute: the token's rise since the sample before it. Before a semaphore's first
            # sample the rise is unknown (a semaphore created again keeps its tokens), so that minute
            # counts from its own first sample, and the grants the instances saw fill what is missing.
            start = previous_token if previous_token is not None else min(s["tokens"])
            grants = max(s["tokens"]) - start
            previous_token = max(s["tokens"])
        if s["seen"]:
            grants = max(grants or 0, s["granted"])
        points.append(
            {
                "t_ms": s["t_ms"],
                "util": round(sum(s["utils"]) / len(s["utils"]), 4) if s["utils"] else None,
                "capacity": s["capacity"],
                "used_max": s["used_max"],
                "grants": grants,
                "refused": s["refused"] if s["seen"] else None,
                "timeouts": s["timeouts"] if s["seen"] else None,
                "wait_p50_ms": _rounded(histogram_percentile(s["hist"], 0.5)),
                "wait_p99_ms": _rounded(histogram_percentile(s["hist"], 0.99)),
                # The samples' own percentiles, the largest of the minute: an upper bound, not a merge.
                "hold_p50_ms": max(s["holds50"]) if s["holds50"] else None,
                "hold_p99_ms": max(s["holds99"]) if s["holds99"] else None,
            }
        )
    return points


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
