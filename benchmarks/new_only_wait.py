"""How long a request for a new lease only (``new_only``) waits for a hot semaphore through the service,
beside a plain request, while other clients keep the semaphore busy.

Through the service, a plain waiter for one permit joins the semaphore's line, which grants the requests
at its head together (group commit, server/handoff.py); a ``new_only`` waiter does not, since a line
answers a key that has a lease with that lease. It asks alone, and polls. This measures what that costs
it: ``--workers`` processes loop acquire, hold ``--hold`` seconds, release, on one semaphore of
``--capacity`` permits; two probe processes do the same with a fresh key each time, one with ``new_only``
and one without, and report how long their acquires waited (each gives up after ``--timeout`` s).

    python benchmarks/new_only_wait.py http://127.0.0.1:8080 [--workers 16] [--capacity 4] [--seconds 25]

The URL is a running ``permits serve``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
import uuid

import permits


def _worker(url: str, name: str, stop_at: float, hold: float) -> None:
    with permits.connect(url, owner=f"worker-{uuid.uuid4().hex[:8]}") as client:
        while time.time() < stop_at:
            lease = client.acquire(name, ttl=30, timeout=30)
            time.sleep(hold)
            client.release(lease)


def _probe(url: str, name: str, stop_at: float, hold: float, timeout: float, new_only: bool, out: mp.Queue) -> None:
    waits: list[float] = []
    timeouts = 0
    with permits.connect(url, owner=f"probe-{uuid.uuid4().hex[:8]}") as client:
        time.sleep(1)  # the workers are busy by now
        while time.time() < stop_at - timeout / 2:
            started = time.monotonic()
            try:
                lease = client.acquire(name, key=uuid.uuid4().hex, ttl=30, timeout=timeout, new_only=new_only)
            except permits.AcquireTimeout:
                timeouts += 1
                continue
            waits.append(time.monotonic() - started)
            time.sleep(hold)
            client.release(lease)
    out.put((new_only, waits, timeouts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="a running permits service (http://host:port)")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--hold", type=float, default=0.005, help="seconds each lease is held")
    parser.add_argument("--timeout", type=float, default=10.0, help="each probe acquire's timeout")
    args = parser.parse_args()
    name = f"new-only-wait-{uuid.uuid4().hex[:8]}"
    with permits.connect(args.url) as admin:
        admin.create_semaphore(name, args.capacity)
    stop_at = time.time() + args.seconds
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_worker, args=(args.url, name, stop_at, args.hold)) for _ in range(args.workers)]
    procs += [
        mp.Process(target=_probe, args=(args.url, name, stop_at, args.hold, args.timeout, flag, out))
        for flag in (False, True)
    ]
    for proc in procs:
        proc.start()
    results = sorted(out.get(timeout=args.seconds + 120) for _ in range(2))
    for proc in procs:
        proc.join(120)
    print("probe     grants  timeouts  mean wait ms  p50 ms  max ms")
    for new_only, waits, timeouts in results:
        label = "new_only" if new_only else "plain"
        if waits:
            mean, median, longest = (1000 * f(waits) for f in (statistics.mean, statistics.median, max))
            figures = f"{mean:12.1f}  {median:6.1f}  {longest:6.1f}"
        else:
            figures = f"{'-':>12}  {'-':>6}  {'-':>6}"
        print(f"{label:8}  {len(waits):6}  {timeouts:8}  {figures}")


if __name__ == "__main__":
    main()
