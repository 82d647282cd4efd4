"""The lines beside a SQLite database (stores/host_lines.py): the write line, and a semaphore's line for its
waiters. Real processes and threads, a real database file.

- Processes on a busy mutex and on a hot semaphore, plain and fair, get about equal turns, none times out,
  and none waits long. (Without the lines, one process of six on a 20 ms mutex took nearly every turn,
  while the others waited seconds in SQLite's busy handler.)
- The line serves its clients in the order they came.
- A client killed in its turn hands the turn on; one stopped in it (SIGSTOP) costs the client behind it
  its patience, and the clients further back move up.
- Where the line's file cannot be had, every client asks unordered, as before, with one warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import permits
import permits._sync.store
from permits.stores.host_lines import RECHECK, WRITE_LINE, HostLines, semaphore_line
from tests._children import run_take_turns

pytestmark = pytest.mark.slow


def _jain(turns: list[int]) -> float:
    return sum(turns) ** 2 / (len(turns) * sum(t * t for t in turns))


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
@pytest.mark.parametrize(
    ("capacity", "hold", "processes"), [(1, 0.02, 6), (10, 0.0, 24)], ids=["mutex-held-20ms", "hot"]
)
def test_processes_take_even_turns_on_sqlite(
    tmp_path: Path, capacity: int, hold: float, processes: int, fair: bool
) -> None:
    """Every process gets about as many turns, none times out, and no acquire or release waits long, with
    every write and every waiting acquire going through the lines. Before them three of the four cases
    failed: on the plain mutex one process of six took nearly every turn (Jain 0.18, the others waiting
    4-4.8 s at a time), and on the hot semaphore 24 processes had 0.83 plain and 0.86 fair."""
    _take_even_turns(tmp_path, capacity, hold, processes, fair)


def test_processes_that_name_one_file_as_a_path_and_as_a_uri_share_its_lines(tmp_path: Path) -> None:
    """As above on the mutex held 20 ms, with three of the six processes naming the file as a writable
    ``file:`` URI (two spellings of it) and three as a plain path: they share one lines file. A URI's
    clients had no lines before cc18df7: they took SQLite's lock unordered, beside the others' line, and
    the turns came out at Jain 0.57-0.58."""
    path = tmp_path / "lines.db"
    urls = [f"sqlite:///file:{path}?mode=rwc&uri=true", f"sqlite:///file://localhost{path}?uri=true"]
    _take_even_turns(tmp_path, 1, 0.02, 6, fair=False, uris=urls)


def _take_even_turns(
    tmp_path: Path, capacity: int, hold: float, processes: int, fair: bool, uris: list[str] | None = None
) -> None:
    """``processes`` children take turns on a semaphore of ``capacity`` in ``tmp_path``'s lines.db for 4 s;
    with ``uris``, every other child names the file by one of them instead of by its path."""
    url = f"sqlite:///{tmp_path / 'lines.db'}"
    with permits.connect(url, auto_upgrade=True) as admin:
        admin.create_semaphore("m", capacity, fair=fair)
        args = {"url": url, "name": "m", "seconds": 4, "hold": hold, "timeout": 5, "tight": True}
        spellings = [url] if uris is None else [spelling for uri in uris for spelling in (url, uri)]
        results = run_take_turns(processes, args, urls=spellings)
        assert admin.get_semaphore("m").used == 0
        assert admin.reconcile() == []
    turns = [r["granted"] for r in results]
    assert all(r["timed_out"] == 0 for r in results), results
    assert _jain(turns) >= 0.9, (_jain(turns), results)
    # The first turns wait for every process to start; after that, a turn of the whole line at most.
    assert max(r["longest_ms"] for r in results) < 3000, results
    assert [f.name for f in tmp_path.iterdir() if f.name.endswith("-permits-lines")] == ["lines.db-permits-lines"]


# --------------------------------------------------------------------------- fair semaphores in the line


def _acquire_in_thread(
    client: permits.Client, name: str, count: int, got: list[tuple[str, float]], who: str
) -> threading.Thread:
    def run() -> None:
        lease = client.acquire({name: count}, key=who, ttl=30, timeout=10)
        got.append((who, time.monotonic()))
        assert lease.key == who

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _watch_places(admin: permits.Client, name: str, seen: list[int], stop: threading.Event) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            seen.append(len(admin.waiters(name)))
            time.sleep(0.002)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(("held", "takes_place"), [(0.02, False), (1.0, True)], ids=["room-soon", "room-late"])
def test_the_head_of_a_fair_semaphores_line_takes_a_place_only_when_its_wait_runs_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: float, takes_place: bool
) -> None:
    """The line orders its waiters, so on a fair semaphore they take no place in its fair queue while they
    wait there: room that comes back within the head's wait goes to the head with no place taken. A head
    whose wait runs out takes a place, and the fair queue orders it from then on."""
    # The head's wait, 50 ms, is ten times as long here: the release must come within it, and on a slow
    # machine a commit that syncs, beside two busy threads, can take most of 50 ms.
    monkeypatch.setattr(permits._sync.store, "LINE_HEAD_WAIT_SECONDS", 0.5)
    url = f"sqlite:///{tmp_path / 'fairhead.db'}"
    with (
        permits.connect(url, auto_upgrade=True, owner="admin") as admin,
        permits.connect(url, owner="holder") as holder,
        permits.connect(url, owner="waiter") as waiter,
    ):
        admin.create_semaphore("m", 1, fair=True)
        lease = holder.acquire("m", ttl=30)
        got: list[tuple[str, float]] = []
        seen: list[int] = []
        stop = threading.Event()
        watcher = _watch_places(admin, "m", seen, stop)
        thread = _acquire_in_thread(waiter, "m", 1, got, "w")
        time.sleep(held)
        holder.release(lease)
        thread.join(10)
        stop.set()
        watcher.join(10)
        assert [who for who, _ in got] == ["w"]
        assert (max(seen) == 1) is takes_place, seen
        assert admin.waiters("m") == []
        waiter.release(waiter.get_lease("w"))
        assert admin.reconcile() == []


def test_a_waiter_in_the_line_does_not_pass_a_place_in_the_fair_queue(tmp_path: Path) -> None:
    """A request that does not use the line (two permits) holds a place in the fair queue; a waiter for one
    permit that comes after it, in the line with no place of its own, is not granted the permit that comes
    back first: the place ahead wants two, and the room is kept for it."""
    url = f"sqlite:///{tmp_path / 'fairpass.db'}"
    with (
        permits.connect(url, auto_upgrade=True, owner="admin") as admin,
        permits.connect(url, owner="big") as big,
        permits.connect(url, owner="small") as small,
    ):
        admin.create_semaphore("m", 2, fair=True)
        held = [admin.acquire("m", key=f"h{i}", ttl=30) for i in range(2)]
        got: list[tuple[str, float]] = []
        big_thread = _acquire_in_thread(big, "m", 2, got, "big")
        deadline = time.monotonic() + 5
        while admin.waiters("m") == [] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [w.owner for w in admin.waiters("m")] == ["big"]
        small_thread = _acquire_in_thread(small, "m", 1, got, "small")
        time.sleep(0.2)
        admin.release(held[0])
        time.sleep(0.3)
        assert got == []  # the permit back is kept for the place ahead, which wants two
        admin.release(held[1])
        big_thread.join(10)
        assert [who for who, _ in got] == ["big"]
        time.sleep(0.2)
        assert [who for who, _ in got] == ["big"]
        big.release(big.get_lease("big"))
        small_thread.join(10)
        assert [who for who, _ in got] == ["big", "small"]
        small.release(small.get_lease("small"))
        assert admin.waiters("m") == []
        assert admin.reconcile() == []


# ------------------------------------------------------------------------------------------ the line itself

#: A child that takes a turn in the write line of the database named in argv[1], says so, and holds it.
_HOLDER = """
import sys, time
from permits.stores.host_lines import WRITE_LINE, HostLines
lines = HostLines(sys.argv[1])
with lines.turn(WRITE_LINE, 5.0) as had:
    print("had" if had else "not", flush=True)
    time.sleep(60)
"""


def _holder(database: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(database)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "had"
    return child


def _enter_in_thread(
    lines: HostLines, patience: float, record: list[tuple[str, bool, float]], who: str
) -> threading.Thread:
    """Start a thread that takes a turn in the write line and records (who, whether it had it, when)."""

    def enter() -> None:
        with lines.turn(WRITE_LINE, patience) as had:
            record.append((who, had, time.monotonic()))

    thread = threading.Thread(target=enter)
    thread.start()
    return thread


def test_the_line_serves_its_clients_in_the_order_they_came(tmp_path: Path) -> None:
    lines = HostLines(str(tmp_path / "order.db"))
    record: list[tuple[str, bool, float]] = []
    with lines.turn(WRITE_LINE, 1.0) as had:
        assert had
        threads = []
        for i in range(8):
            threads.append(_enter_in_thread(lines, 10.0, record, f"t{i}"))
            time.sleep(0.05)  # each has its ticket before the next comes
        assert record == []  # all wait behind this turn
    for thread in threads:
        thread.join(10)
    assert [who for who, _, _ in record] == [f"t{i}" for i in range(8)]
    assert all(had for _, had, _ in record)
    # Semaphores have lines of their own: a busy write line holds none of them up.
    with lines.turn(WRITE_LINE, 1.0):
        assert not lines.busy(semaphore_line("m"))
        assert lines.busy(WRITE_LINE)
    assert not lines.busy(WRITE_LINE)
    lines.close()


def test_a_client_killed_in_its_turn_hands_the_turn_on(tmp_path: Path) -> None:
    database = tmp_path / "killed.db"
    holder = _holder(database)
    lines = HostLines(str(database))
    record: list[tuple[str, bool, float]] = []
    waiter = _enter_in_thread(lines, 10.0, record, "next")
    time.sleep(0.2)
    assert record == []
    killed_at = time.monotonic()
    holder.kill()
    holder.wait()
    waiter.join(10)
    [(_, had, at)] = record
    # The kernel dropped the dead client's lock; no wake-up came, so the next one saw it at its next look.
    assert had and at - killed_at < RECHECK + 1.0
    lines.close()


def test_a_stopped_client_costs_the_one_behind_it_its_patience_and_the_rest_move_up(tmp_path: Path) -> None:
    database = tmp_path / "stopped.db"
    holder = _holder(database)
    holder.send_signal(signal.SIGSTOP)
    lines = HostLines(str(database))
    record: list[tuple[str, bool, float]] = []
    try:
        started = time.monotonic()
        impatient = _enter_in_thread(lines, 0.5, record, "impatient")
        time.sleep(0.1)
        patient = _enter_in_thread(lines, 10.0, record, "patient")
        impatient.join(10)
        patient.join(10)
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait()
    by_who = {who: (had, at - started) for who, had, at in record}
    # The one right behind the stopped client gave up at its patience and went on without the line; the one
    # behind it moved up then, rather than wait for the stopped client too.
    assert by_who["impatient"][0] is False and 0.45 <= by_who["impatient"][1] < 2.0, by_who
    assert by_who["patient"][0] is True and by_who["patient"][1] < 0.5 + RECHECK + 1.0, by_who
    lines.close()


def test_without_the_lines_file_every_client_asks_unordered(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    database = tmp_path / "nofile.db"
    (tmp_path / "nofile.db-permits-lines").mkdir()  # the file cannot be opened
    url = f"sqlite:///{database}"
    with caplog.at_level(logging.WARNING, logger="permits.store"), permits.connect(url, auto_upgrade=True) as client:
        client.create_semaphore("m", 1)
        for _ in range(3):
            with client.lease("m", timeout=5) as lease:
                assert lease.tokens["m"] > 0
    warnings = [r for r in caplog.records if "lines" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert os.path.isdir(tmp_path / "nofile.db-permits-lines")


def test_lines_that_could_not_be_had_are_tried_again_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure that passes (no file descriptor left, say) costs the order for ``RETRY_AFTER`` seconds,
    not for the rest of the process's life; it warns once."""
    monkeypatch.setattr("permits.stores.host_lines.RETRY_AFTER", 0.3)
    blocker = tmp_path / "again.db-permits-lines"
    blocker.mkdir()  # the file cannot be opened
    lines = HostLines(str(tmp_path / "again.db"))
    with caplog.at_level(logging.DEBUG, logger="permits.store"):
        with lines.turn(WRITE_LINE, 1.0) as had:
            assert not had
        assert not lines.usable()  # so a semaphore's waiters wait as without the lines meanwhile
        blocker.rmdir()
        with lines.turn(WRITE_LINE, 1.0) as had:
            assert not had  # not tried again yet
        time.sleep(0.4)
        assert lines.usable()
        with lines.turn(WRITE_LINE, 1.0) as had:
            assert had
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "lines" in r.getMessage()]
    assert len(warnings) == 1, warnings
    lines.close()


def test_a_client_interrupted_in_the_line_leaves_no_place_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while a client waits in the line: its place goes with it, so the client behind does not wait
    out its patience on a place nobody will give up."""
    lines = HostLines(str(tmp_path / "interrupted.db"))
    record: list[tuple[str, bool, float]] = []
    with lines.turn(WRITE_LINE, 1.0):

        def interrupted(*args: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr("permits.stores.host_lines.select.select", interrupted)
        with pytest.raises(KeyboardInterrupt), lines.turn(WRITE_LINE, 5.0):
            pytest.fail("the interrupted client had a turn")
        monkeypatch.undo()
        waiter = _enter_in_thread(lines, 5.0, record, "next")
        time.sleep(0.1)
        left_at = time.monotonic()
    waiter.join(10)
    [(_, had, at)] = record
    assert had and at - left_at < RECHECK + 1.0, at - left_at
    lines.close()


#: A client that takes a turn (so it keeps a spare open file of the lines), forks a child that lives on,
#: then takes a turn again on that same open file and holds it.
_FORKER = """
import os, sys, time
from permits.stores.host_lines import WRITE_LINE, HostLines
lines = HostLines(sys.argv[1])
with lines.turn(WRITE_LINE, 5.0):
    pass
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
print(child, flush=True)
with lines.turn(WRITE_LINE, 5.0) as had:
    print("had" if had else "not", flush=True)
    time.sleep(60)
"""


def test_a_client_killed_in_its_turn_hands_it_on_while_its_forked_child_lives(tmp_path: Path) -> None:
    """A forked child holds copies of its parent's open files, and a lock lasts while any copy is open: the
    child closes its copies, so the parent's death still ends its turn."""
    database = tmp_path / "forked.db"
    parent = subprocess.Popen([sys.executable, "-c", _FORKER, str(database)], stdout=subprocess.PIPE, text=True)
    lines = HostLines(str(database))
    child = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "had"
        record: list[tuple[str, bool, float]] = []
        waiter = _enter_in_thread(lines, 5.0, record, "next")
        time.sleep(0.2)
        killed_at = time.monotonic()
        parent.kill()
        parent.wait()
        waiter.join(10)
        [(_, had, at)] = record
        assert had and at - killed_at < RECHECK + 1.0, at - killed_at
    finally:
        parent.kill()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        lines.close()
