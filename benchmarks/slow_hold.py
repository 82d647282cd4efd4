"""How a busy mutex keeps its pace through one slow holder.

``--workers`` processes loop acquire, hold ``--hold`` seconds, release, on one mutex (fair unless
``--plain``). After ``--before`` seconds, this process takes one turn too and holds it ``--slow`` seconds; then
the workers go on for ``--after`` seconds. It prints the turns in each second (from the semaphore's token
counter), and how long after the slow hold the turns took to come back to 90% of their rate before it
(``--slow 0 --after 0``: the pace alone, as with holds of 100 ms, where the fair queue is always in use). A
slow hold longer than the head of MariaDB's line waits for room (50 ms) sends waiters to the fair queue,
whose waiters poll (docs/design.md, "MariaDB's line").

    python benchmarks/slow_hold.py mariadb://root@127.0.0.1:3306/permits_bench [--runs 20]
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
        client.get_semaphore(name)  # connected before the measurement starts
        while time.time() < stop_at:
            lease = client.acquire(name, ttl=30, timeout=30)
            time.sleep(hold)
            client.release(lease)


def _one_run(args: argparse.Namespace, client: permits.Client) -> tuple[list[int], int, float | None]:
    """Turns per second, the index of the second the slow hold began in, and the recovery time (None: not
    within the run)."""
    name = f"slow-hold-{uuid.uuid4().hex[:8]}"
    client.create_semaphore(name, 1, fair=not args.plain)
    settle = 1.5  # the workers connect and start
    # (and some slack: the slow hold's own acquire waits its turn first)
    stop_at = time.time() + settle + args.before + args.slow + args.after + 3.0
    workers = [mp.Process(target=_worker, args=(args.url, name, stop_at, args.hold)) for _ in range(args.workers)]
    for worker in workers:
        worker.start()
    try:
        time.sleep(settle)
        per_second: list[int] = []
        last = client.get_semaphore(name).last_token
        tick = time.monotonic()

        def sample() -> None:
            nonlocal last, tick
            tick += 1.0
            time.sleep(max(0.0, tick - time.monotonic()))
            token = client.get_semaphore(name).last_token
            per_second.append(token - last)
            last = token

        for _ in range(round(args.before)):
            sample()
        slow_at = len(per_second)
        lease = client.acquire(name, ttl=30, timeout=30)
        time.sleep(args.slow)
        client.release(lease)
        released = time.monotonic()
        tick = released  # seconds counted from the end of the slow hold
        last = client.get_semaphore(name).last_token
        for _ in range(round(args.after)):
            sample()
    finally:
        for worker in workers:
            worker.join(timeout=60)
    client.delete_semaphore(name, force=True)
    pace = statistics.mean(per_second[1:slow_at]) if slow_at > 1 else per_second[0]
    back = next((i + 1.0 for i, turns in enumerate(per_second[slow_at:]) if turns >= 0.9 * pace), None)
    return per_second, slow_at, back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="a database URL (the benchmark creates its own semaphores there)")
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--hold", type=float, default=0.02, help="seconds each worker holds the mutex")
    parser.add_argument("--slow", type=float, default=0.3, help="seconds of the one slow hold")
    parser.add_argument("--before", type=float, default=4.0, help="seconds measured before the slow hold")
    parser.add_argument("--after", type=float, default=10.0, help="seconds measured after it")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--plain", action="store_true", help="a plain mutex instead of a fair one")
    args = parser.parse_args()
    backs: list[float | None] = []
    with permits.connect(args.url, owner="slow-hold", auto_upgrade=True) as client:
        for run in range(args.runs):
            per_second, slow_at, back = _one_run(args, client)
            backs.append(back)
            before, after = per_second[:slow_at], per_second[slow_at:]
            said = "not measured" if not after else "not back" if back is None else f"back within {back:.0f} s"
            print(f"run {run + 1}: turns a second {before} | slow hold | {after}: {said}", flush=True)
    within_one = sum(1 for back in backs if back is not None and back <= 1.0)
    print(f"{within_one} of {len(backs)} runs back to 90% of their pace in the first second after the slow hold")


if __name__ == "__main__":
    main()
