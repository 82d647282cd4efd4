"""What one NOTIFY costs the PostgreSQL server, against how many backends LISTEN in the same database.

PostgreSQL (up to at least 15) signals every backend of the database that LISTENs to any channel at each
NOTIFY, whatever its channel; each signalled backend reads the notification queue and drops what it does
not listen to. So a notification costs the server time per listening backend, even one that waits for
nothing now. This is why permits' listeners LISTEN only while one of their waiters waits (and a little
longer), and why the waiters of a fair queue are called on channels of their own rather than woken by a
broadcast (docs/benchmarks.md).

    python benchmarks/notify_cost.py [--url postgresql://postgres@127.0.0.1:5432/test] [--listeners 0,16,64]

For each count, opens that many connections that LISTEN on channels nobody notifies, then sends NOTIFYs
on another channel from one connection for ``--seconds``, and reports the NOTIFYs per second and the CPU
time all postgres processes spent per NOTIFY (from /proc, so run it on the database's machine).
"""

from __future__ import annotations

import argparse
import os
import time

import psycopg


def postgres_cpu_seconds() -> float:
    ticks = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.index("(") + 1 : stat.rindex(")")] != "postgres":
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(url: str, listeners: int, seconds: float) -> tuple[float, float]:
    idle = [psycopg.connect(url, autocommit=True) for _ in range(listeners)]
    try:
        for index, conn in enumerate(idle):
            conn.execute(f"LISTEN permits_bench_idle_{index}")
        with psycopg.connect(url, autocommit=True) as sender:
            before, started, sent = postgres_cpu_seconds(), time.monotonic(), 0
            while time.monotonic() - started < seconds:
                sender.execute("SELECT pg_notify('permits_bench_nobody', 'x')")
                sent += 1
            elapsed, cpu = time.monotonic() - started, postgres_cpu_seconds() - before
        return sent / elapsed, cpu / sent
    finally:
        for conn in idle:
            conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--listeners", default="0,16,64", help="comma list of listening connections")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    print("listening backends  NOTIFYs/s  server CPU per NOTIFY")
    for count in (int(n) for n in args.listeners.split(",")):
        rate, cpu = measure(args.url, count, args.seconds)
        print(f"{count:18d}  {rate:9.0f}  {cpu * 1000:8.3f} ms")


if __name__ == "__main__":
    main()
