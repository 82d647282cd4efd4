"""Sixteen processes share two semaphores: capacity is never exceeded, fencing tokens follow grant order.

Each child (tests/_children.py ``cycles``) acquires one permit of ``a`` (capacity 3), of ``b`` (capacity
2) or of both at once, holds it for up to a few milliseconds and releases it, recording every holding
interval on CLOCK_MONOTONIC, which is one clock for the whole machine. A recorded interval lies inside the
real one (it starts after the grant committed and ends before the release began), so recorded intervals
that overlap were really held at the same time.

Sized for two cores: 16 x 80 cycles take 10 to 20 s per backend, most of it spent with permits held.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import permits
from tests._children import spawn

PROCESSES = 16
CYCLES = 80
CAPACITIES = {"a": 3, "b": 2}
MAX_HOLD = 0.01  # seconds a child holds its permits, at most
ACQUIRE_TIMEOUT = 25.0
#: Only a hang detector: 16 x 80 cycles of two commits each take 10-20 s on a usual machine, and a disk that
#: syncs in 15-20 ms makes it 45-60 s.
RUN_TIMEOUT = 240.0


def _max_overlap(intervals: list[tuple[float, float, int]]) -> tuple[int, float]:
    """The largest number of permits held at one instant (sweep line), and that instant.

    At equal times a release is counted before an acquire, which only ever lowers the result; equal
    readings of the nanosecond clock do not happen in practice anyway.
    """
    events = sorted([(start, count) for start, _, count in intervals] + [(end, -count) for _, end, count in intervals])
    held = peak = 0
    when = 0.0
    for t, delta in events:
        held += delta
        if held > peak:
            peak, when = held, t
    return peak, when


def _token_order_violations(records: list[dict[str, Any]], name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs (A, B) where A had been granted before B was, yet token(A) >= token(B).

    "Before" is what the clocks can prove: A's acquire had returned (so A's token was handed out and
    committed) before B's last attempt, the one that was granted, began (so B's token was handed out
    after). This covers every pair where A's hold ended before B's attempt; it leaves out only pairs whose
    order the clocks cannot tell. (Comparing A's end with B's *return* would not be sound: B may be
    granted before A and only get to run after A has released.)
    """
    mine = [r for r in records if name in r["tokens"]]
    by_return = sorted(mine, key=lambda r: r["t_acq"])
    by_attempt = sorted(mine, key=lambda r: r["t_try"])
    bad: list[tuple[dict[str, Any], dict[str, Any]]] = []
    best: dict[str, Any] | None = None  # the largest token among the acquires that had returned
    i = 0
    for later in by_attempt:
        while i < len(by_return) and by_return[i]["t_acq"] < later["t_try"]:
            if best is None or by_return[i]["tokens"][name] > best["tokens"][name]:
                best = by_return[i]
            i += 1
        if best is not None and best["tokens"][name] >= later["tokens"][name]:
            bad.append((best, later))
    return bad


def test_the_checks_catch_what_they_look_for() -> None:
    """The two checks are not vacuous: they flag an overlap beyond capacity and a token out of order."""
    assert _max_overlap([(0.0, 2.0, 1), (1.0, 3.0, 1), (2.5, 4.0, 1)]) == (2, 1.0)
    assert _max_overlap([(0.0, 1.0, 1), (1.0, 2.0, 1)])[0] == 1  # one ends as the other begins

    def rec(t_try: float, t_acq: float, token: int) -> dict[str, Any]:
        return {"t_call": t_try, "t_try": t_try, "t_acq": t_acq, "t_rel": t_acq + 0.1, "tokens": {"s": token}}

    in_order = [rec(0.0, 1.0, 1), rec(2.0, 3.0, 2), rec(0.5, 5.0, 3)]
    assert _token_order_violations(in_order, "s") == []
    # Granted in an order the clocks cannot tell apart (both attempts began before either returned): fine.
    assert _token_order_violations([rec(0.0, 2.0, 2), rec(1.0, 3.0, 1)], "s") == []
    # The second attempt began after the first acquire returned, yet carries the smaller token.
    late = [rec(0.0, 1.0, 5), rec(2.0, 3.0, 4)]
    assert _token_order_violations(late, "s") == [(late[0], late[1])]


@pytest.mark.slow
def test_sixteen_processes_two_semaphores(db_url: str, ns: str, tmp_path: Path) -> None:
    run_and_check(db_url, ns, tmp_path, PROCESSES, CYCLES)


def run_and_check(
    db_url: str,
    ns: str,
    tmp_path: Path,
    processes: int,
    cycles: int,
    child_urls: list[str] | None = None,
    meanwhile: Callable[[], None] | None = None,
    diagnose: Callable[[], str] | None = None,
) -> None:
    """``processes`` children each run ``cycles`` acquire-hold-release cycles on ``a`` and ``b``; then every
    check above runs on what they recorded, and the database is checked to hold nothing. ``child_urls``:
    child i talks to ``child_urls[i % len(child_urls)]`` (the nodes of a cluster); default ``db_url``.
    ``meanwhile`` runs once all children have been told to start, while they run. Each child's stderr is
    left in ``tmp_path / f"child{i}.err"``. ``diagnose``: called as soon as a child is seen to have failed, while
    the others still run, for what the database says of its sessions then (who holds the locks), which the
    failure's message then carries."""
    urls = child_urls or [db_url]
    names = {short: f"{ns}{short}" for short in CAPACITIES}
    with permits.connect(db_url) as client:
        for short, capacity in CAPACITIES.items():
            client.create_semaphore(names[short], capacity)

        procs: list[subprocess.Popen[str]] = []
        errs: list[Path] = []
        try:
            for i in range(processes):
                errs.append(tmp_path / f"child{i}.err")
                with errs[-1].open("w") as err:
                    procs.append(
                        spawn(
                            "cycles",
                            {
                                "url": urls[i % len(urls)],
                                "owner": f"{ns}child{i}",
                                "names": [names["a"], names["b"]],
                                "cycles": cycles,
                                "seed": i,
                                "ttl": 60,
                                "timeout": ACQUIRE_TIMEOUT,
                                "max_hold": MAX_HOLD,
                                "out": str(tmp_path / f"child{i}.json"),
                            },
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            stderr=err,
                        )
                    )
            for i, proc in enumerate(procs):
                assert proc.stdout is not None
                line = proc.stdout.readline().strip()
                assert line == "ready", f"child {i} did not start: {errs[i].read_text()[-2000:]}"
            started = time.monotonic()
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            if meanwhile is not None:
                meanwhile()
            # (c) every child exits 0 having completed every cycle
            for i, proc in enumerate(procs):
                code = proc.wait(timeout=max(1.0, RUN_TIMEOUT - (time.monotonic() - started)))
                if code != 0:
                    seen = "" if diagnose is None else "\n" + diagnose()
                    raise AssertionError(f"child {i} exited {code}: {errs[i].read_text()[-2000:]}{seen}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                for stream in (proc.stdin, proc.stdout):
                    if stream is not None:
                        stream.close()

        records: list[dict[str, Any]] = []
        for i in range(processes):
            mine = json.loads((tmp_path / f"child{i}.json").read_text())
            assert len(mine) == cycles, f"child {i} completed {len(mine)} of {cycles} cycles"
            assert all(r["outcome"] == "released" for r in mine)
            records.extend(mine)

        for short, capacity in CAPACITIES.items():
            name = names[short]
            holding = [r for r in records if name in r["tokens"]]
            assert holding, f"nobody ever held {name}"
            # (a) never more holders at one instant than the capacity
            for r in holding:
                assert r["t_call"] <= r["t_try"] <= r["t_acq"] <= r["t_rel"]
            peak, when = _max_overlap([(r["t_acq"], r["t_rel"], r["counts"][name]) for r in holding])
            assert peak <= capacity, f"{peak} permits of {name} (capacity {capacity}) held at once, at {when}"
            # (b) tokens are unique, and a grant that came after another carries a larger token
            tokens = [r["tokens"][name] for r in holding]
            assert len(set(tokens)) == len(tokens), f"a token of {name} was handed out twice"
            violations = _token_order_violations(records, name)
            assert not violations, f"token order broken on {name}: {violations[:3]}"
            # (d) the database agrees: nothing held, the last token is the largest one handed out
            sem = client.get_semaphore(name)
            assert sem.used == 0
            assert sem.last_token == max(tokens)
            assert client.holders(name) == []
        assert client.reconcile() == []
