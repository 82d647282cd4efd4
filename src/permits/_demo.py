"""``permits demo``: several real processes share one semaphore through ``permits run``.

Each worker is ``permits run demo -- python -c <job>``; the job prints when it starts and ends. Starts are
printed after the permit is granted and ends before it is released, so the number of jobs running at once,
as seen here, can never exceed what the database granted: if it ever exceeds the capacity, capacity did
not hold, and the demo says so and fails.
"""

from __future__ import annotations

import queue
import shlex
import subprocess
import sys
import threading
import time

import click

import permits

SEMAPHORE = "demo"

_JOB = (
    "import sys, time; w = sys.argv[1]; "
    "print('start', w, flush=True); time.sleep(float(sys.argv[2])); print('end', w, flush=True)"
)


def run_demo(db: str | None, *, workers: int, capacity: int, hold: float, rounds: int) -> bool:
    with permits.connect(db) as client:
        try:
            client.create_semaphore(SEMAPHORE, capacity, exist_ok=True)
        except permits.SemaphoreExists:
            client.set_capacity(SEMAPHORE, capacity, reason="permits demo")
        url = client.url
    click.echo(f"permits demo: {workers} processes x {rounds} turns, semaphore {SEMAPHORE!r} of capacity {capacity}")
    click.echo(f"database: {url}\n")

    events: queue.Queue[tuple[float, str, str]] = queue.Queue()
    procs = []
    for w in range(1, workers + 1):
        run = [sys.executable, "-m", "permits", "run", SEMAPHORE, "--ttl", "10", *(["--db", db] if db else [])]
        job = [sys.executable, "-c", _JOB, str(w), str(hold)]
        # Each worker takes its turns one after another, as a shell loop of `permits run` calls would.
        script = " && ".join([shlex.join([*run, "--", *job])] * rounds)
        proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        threading.Thread(target=_pump, args=(proc, events), daemon=True).start()

    t0 = time.monotonic()
    running: set[str] = set()
    peak = 0
    expected = workers * rounds * 2
    seen = 0
    while seen < expected:
        try:
            at, kind, worker = events.get(timeout=60)
        except queue.Empty:
            click.echo("permits demo: workers stopped reporting", err=True)
            break
        seen += 1
        if kind == "start":
            running.add(worker)
        else:
            running.discard(worker)
        peak = max(peak, len(running))
        bar = "#" * len(running) + "." * max(0, capacity - len(running))
        click.echo(f"{at - t0:6.2f}s  worker {worker:>2} {kind:<5}  [{bar}] {len(running)}/{capacity} running")
    failed = [p for p in procs if p.wait() != 0]
    ok = peak <= capacity and not failed and seen == expected
    verdict = "capacity held" if peak <= capacity else "CAPACITY EXCEEDED"
    click.echo(f"\nat most {peak} of {capacity} ran at once: {verdict}; {seen // 2} jobs ran")
    if failed:
        click.echo(f"{len(failed)} worker(s) failed", err=True)
    return ok


def _pump(proc: subprocess.Popen[str], events: queue.Queue[tuple[float, str, str]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        kind, _, worker = line.strip().partition(" ")
        if kind in ("start", "end"):
            events.put((time.monotonic(), kind, worker))
