"""Child processes for the concurrency and fault tests.

Every child is a real OS process: ``python -m tests._children <command> <json-args>``, started by
``spawn`` below with the repository root as working directory. Children talk to the parent through
files and short lines on stdout (never much data through pipes, so no pipe can fill up and block).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import permits

ROOT = Path(__file__).resolve().parent.parent


def spawn(command: str, args: dict[str, Any], **popen: Any) -> subprocess.Popen[str]:
    """Start ``command`` of this module in a fresh interpreter (a real OS process, nothing inherited)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests._children", command, json.dumps(args)],
        cwd=ROOT,
        text=True,
        **popen,
    )


def lease_to_json(lease: permits.Lease) -> dict[str, Any]:
    return lease.to_dict()


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------------- cycles


def cycles(args: dict[str, Any]) -> None:
    """Acquire and release ``cycles`` times, recording each holding interval on the system-wide clock.

    Waits for a ``go`` line on stdin after connecting, so that every child starts hammering at once.
    Writes a JSON list of records to ``args["out"]``; each record is one cycle: the names and tokens held,
    ``t_call`` (just before acquire was called), ``t_try`` (just before its last attempt, the one that was
    granted, went to the store), ``t_acq`` (just after it returned) and ``t_rel`` (just before release was
    called), all ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for the machine).
    """
    rng = random.Random(args["seed"])
    a, b = args["names"]
    choices = [{a: 1}, {b: 1}, {a: 1, b: 1}]
    weights = [0.4, 0.4, 0.2]
    records: list[dict[str, Any]] = []
    with permits.connect(args["url"], owner=args["owner"]) as client:
        attempt = client._store.try_acquire
        last_try = [0.0]

        def timed_attempt(*a: Any, **kw: Any) -> Any:
            last_try[0] = time.monotonic()
            return attempt(*a, **kw)

        client._store.try_acquire = timed_attempt  # type: ignore[method-assign]
        client.get_semaphore(a)  # connect and check the schema before the start signal
        _say("ready")
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("no start signal")
        for i in range(args["cycles"]):
            wants = rng.choices(choices, weights)[0]
            key = f"{args['owner']}-{i}"
            t_call = time.monotonic()
            lease = client.acquire(wants, key=key, ttl=args["ttl"], timeout=args["timeout"])
            t_acq = time.monotonic()
            hold = rng.uniform(0, args["max_hold"])
            if hold:
                time.sleep(hold)
            t_rel = time.monotonic()
            outcome = client.release(lease)
            records.append(
                {
                    "key": key,
                    "counts": lease.counts,
                    "tokens": lease.tokens,
                    "t_call": t_call,
                    "t_try": last_try[0],
                    "t_acq": t_acq,
                    "t_rel": t_rel,
                    "outcome": str(outcome),
                }
            )
    Path(args["out"]).write_text(json.dumps(records))


# --------------------------------------------------------------------------------------------------- hold


def hold(args: dict[str, Any]) -> None:
    """Acquire, say ``held <lease json>``, then sleep until killed."""
    client = permits.connect(args["url"], owner=args["owner"])
    lease = client.acquire(args["wants"], key=args["key"], ttl=args["ttl"], timeout=10)
    _say("held " + json.dumps(lease_to_json(lease)))
    while True:
        time.sleep(60)


# -------------------------------------------------------------------------------------- kill in statement


def operate(args: dict[str, Any]) -> None:
    """Run one acquire or release with a hook after every statement of the store.

    ``kill_after``: SIGKILL this process right after the k-th statement ran (inside the transaction, before
    it commits). ``stop_after``: say ``stopping after <statement>`` and SIGSTOP this process there instead
    (frozen, its connection and locks kept, until the parent sends SIGCONT or SIGKILL). ``kill_at_end``:
    SIGKILL it right after the operation returned. Then print the names of the statements that ran and the
    result, as JSON.
    """
    kill_after: int | None = args.get("kill_after")
    stop_after: int | None = args.get("stop_after")
    ran: list[str] = []

    def after_statement(name: str) -> None:
        ran.append(name)
        if kill_after is not None and len(ran) == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        if stop_after is not None and len(ran) == stop_after:
            _say(f"stopping after {name}")
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen inside the transaction until SIGCONT

    client = permits.connect(args["url"], owner=args["owner"])
    client._store.open()  # the schema check runs its own statements; only the operation's are counted
    client._store.after_statement = after_statement  # type: ignore[attr-defined]  # the SQL store's test hook
    if args["op"] == "acquire":
        result: Any = lease_to_json(client.acquire(args["wants"], key=args["key"], ttl=args["ttl"], timeout=5))
    elif args["op"] == "release":
        result = str(client.release(args["key"]))
    else:
        raise SystemExit(f"unknown op {args['op']!r}")
    if args.get("kill_at_end"):
        os.kill(os.getpid(), signal.SIGKILL)
    _say(json.dumps({"statements": ran, "result": result}))
    client.close()


# ------------------------------------------------------------------------------------------ fenced writer


def fenced_writer(args: dict[str, Any]) -> None:
    """Acquire a lease, then write to a downstream table through the fencing guard, once per line on stdin.

    Says ``held <token>`` once it holds the lease and ``accepted`` or ``refused <highest>`` for each write.
    The parent freezes it (SIGSTOP) between writes to make its lease go stale.
    """
    from sqlalchemy import create_engine, text

    from permits.fencing import FencingGuard, StaleFencingToken

    guard = FencingGuard()
    engine = create_engine(args["downstream"])
    with permits.connect(args["url"], owner=args["owner"]) as client:
        lease = client.acquire(args["name"], ttl=args["ttl"], timeout=10)
        _say(f"held {lease.token}")
        for line in sys.stdin:
            value = line.strip()
            try:
                with engine.begin() as conn:
                    guard.check(conn, args["resource"], lease.token)
                    conn.execute(
                        text("UPDATE fenced_doc SET body = :body, token = :token WHERE id = 1"),
                        {"body": value, "token": lease.token},
                    )
            except StaleFencingToken as exc:
                _say(f"refused {exc.details['highest']}")
            else:
                _say("accepted")
    engine.dispose()


# ---------------------------------------------------------------------------------------------- turns


def take_turns(args: dict[str, Any]) -> None:
    """Acquire ``name`` (or one permit of each of ``names``), hold it ``hold`` seconds and release it, again
    and again for ``seconds``; then say how many grants and how many timeouts this process had, how many
    attempts its acquires made (on a database: the statements that try to take room, one per attempt and
    semaphore, whether or not it waits in the server's line), how many of them waited in the lines of
    several semaphores (LINES_ENTER, or the queued grant that takes its line), how many asked outside a
    line first (ACQUIRE_ONE_LINE_FREE), how many of those were refused there and then asked in the line
    (ACQUIRE_ONE_QUEUED or MariaDB's LINE_WAIT right after it), how many asked at the head of MariaDB's
    line (LINE_GRANT, ``in_line``), and how many were made by a request that held a place in a fair queue
    (``queued``: ordered by that queue, not by a line), as one JSON line."""
    granted = timed_out = 0
    longest = 0.0  # the longest acquire or release that did not time out, in seconds
    attempts = [0]
    lines = [0]
    line_free = [0]
    line_refused = [0]
    in_line = [0]
    queued = [0]
    last = [""]
    # ``names`` instead of ``name``: one permit of each, in one acquire
    wants: Any = dict.fromkeys(args["names"], 1) if "names" in args else args["name"]
    with permits.connect(args["url"], owner=args["owner"]) as client:
        if hasattr(client._store, "after_statement"):

            def count(statement: str) -> None:
                attempt = statement in (
                    "ACQUIRE_ONE",
                    "ACQUIRE_ONE_QUEUED",
                    "ACQUIRE_ONE_LINE_FREE",
                    "LINE_GRANT",
                    "SEM_TAKE",
                )
                attempts[0] += attempt
                # This process has one acquire at a time: any place its store keeps is that request's.
                queued[0] += attempt and bool(client._store._queued)
                line_free[0] += statement == "ACQUIRE_ONE_LINE_FREE"
                if statement in ("ACQUIRE_MANY", "ACQUIRE_MANY_QUEUED"):  # one statement for all the semaphores
                    attempts[0] += len(wants)
                lines[0] += statement in ("LINES_ENTER", "ACQUIRE_MANY_QUEUED")
                in_line[0] += statement == "LINE_GRANT"
                asked_in_line = statement in ("ACQUIRE_ONE_QUEUED", "LINE_WAIT")
                line_refused[0] += last[0] == "ACQUIRE_ONE_LINE_FREE" and asked_in_line
                last[0] = statement

            client._store.after_statement = count
        client.get_semaphore(args["names"][0] if "names" in args else args["name"])  # connected before the start
        _say("ready")
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("no start signal")
        end = time.monotonic() + args["seconds"]
        while time.monotonic() < end:
            asked = time.monotonic()
            try:
                lease = client.acquire(wants, ttl=30, timeout=args["timeout"])
            except permits.AcquireTimeout:
                timed_out += 1
                continue
            held = time.monotonic()
            if args["hold"] or not args.get("tight"):  # tight: not even sleep(0), which lets others run
                time.sleep(args["hold"])
            releasing = time.monotonic()
            client.release(lease)
            longest = max(longest, held - asked, time.monotonic() - releasing)
            granted += 1
    report = {"granted": granted, "timed_out": timed_out, "attempts": attempts[0], "lines": lines[0]}
    longest_ms = round(longest * 1000)
    report.update(line_free=line_free[0], line_refused=line_refused[0], in_line=in_line[0], queued=queued[0])
    report.update(longest_ms=longest_ms)
    _say(json.dumps(report))


def run_take_turns(
    processes: int,
    args: dict[str, Any],
    meanwhile: Callable[[list[subprocess.Popen[str]]], None] | None = None,
    urls: list[str] | None = None,
) -> list[dict[str, int]]:
    """Parent side: start ``processes`` children of ``take_turns`` (owners p0, p1, ...), start them together,
    and return what each reported. ``meanwhile`` is called with the children once they have started (to
    stop them for a while, say). ``urls``: child i connects with ``urls[i % len(urls)]`` instead of
    ``args["url"]`` (several spellings of one database)."""
    children = [
        spawn(
            "take_turns",
            {**args, "owner": f"p{i}", **({"url": urls[i % len(urls)]} if urls else {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for i in range(processes)
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        if meanwhile is not None:
            meanwhile(children)
        results = []
        for child in children:
            out, _ = child.communicate(timeout=60)
            assert child.returncode == 0
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()


# ---------------------------------------------------------------------------------------------- impatient


def impatient(args: dict[str, Any]) -> None:
    """Until ``args["stop"]`` exists: acquire with a short ``timeout`` under a new key each time, give up
    on a timeout, release at once when granted. Says ``ready`` once connected; at the end prints a JSON
    line with the ``time.monotonic()`` of each grant and the number of timeouts."""
    grants: list[float] = []
    timeouts = 0
    with permits.connect(args["url"], owner=args["owner"]) as client:
        client.get_semaphore(args["name"])
        _say("ready")
        stop = Path(args["stop"])
        i = 0
        while not stop.exists():
            i += 1
            try:
                lease = client.acquire(args["name"], key=f"{args['owner']}-{i}", ttl=30, timeout=args["timeout"])
            except permits.AcquireTimeout:
                timeouts += 1
                continue
            grants.append(time.monotonic())
            client.release(lease)
    _say(json.dumps({"grants": grants, "timeouts": timeouts}))


COMMANDS = {
    "impatient": impatient,
    "cycles": cycles,
    "hold": hold,
    "operate": operate,
    "fenced_writer": fenced_writer,
    "take_turns": take_turns,
}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]](json.loads(sys.argv[2]))
