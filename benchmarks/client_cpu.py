"""Client CPU per acquire+release cycle, in one process: what the library itself costs on top of the
database's round trips.

    python benchmarks/client_cpu.py postgresql://postgres@127.0.0.1:5432/permits_bench --cycles 3000

One client, one semaphore of capacity 10, ``acquire`` then ``release`` in a loop after as many uncounted
cycles of warm-up. Prints cycles/s, the process's user+system CPU per cycle (``resource.getrusage``) and
the wall time per cycle (``--asyncio``: the same on ``connect_async``). Comparing two versions: run it
with ``PYTHONPATH`` pointing at each one's ``src``, alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import time

import permits


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _count_from_here(callgrind: bool) -> None:
    """Under callgrind started with ``--instr-atstart=no`` (client_instructions.py), switches its
    instrumentation on: the interpreter's start-up, the imports and the connect then run at valgrind's
    uninstrumented speed, about 6x faster, and are left out of the count. The few instructions of this call
    after the switch are the same in every run, so they cancel out of client_instructions.py's difference."""
    if callgrind:
        subprocess.run(["callgrind_control", "--instr=on", str(os.getpid())], check=True, capture_output=True)


def _measure_sync(url: str, count: int, callgrind: bool = False) -> tuple[float, float]:
    with permits.connect(url, auto_upgrade=True) as client:
        client.create_semaphore("client-cpu", 10, exist_ok=True)
        _count_from_here(callgrind)

        def cycles(count: int) -> None:
            for _ in range(count):
                client.release(client.acquire("client-cpu", ttl=30, timeout=5))

        cycles(count)
        cpu, wall = _cpu_seconds(), time.perf_counter()
        cycles(count)
        return _cpu_seconds() - cpu, time.perf_counter() - wall


async def _measure_async(url: str, count: int, callgrind: bool = False) -> tuple[float, float]:
    async with permits.connect_async(url, auto_upgrade=True) as client:
        await client.create_semaphore("client-cpu", 10, exist_ok=True)
        _count_from_here(callgrind)

        async def cycles(count: int) -> None:
            for _ in range(count):
                await client.release(await client.acquire("client-cpu", ttl=30, timeout=5))

        await cycles(count)
        cpu, wall = _cpu_seconds(), time.perf_counter()
        await cycles(count)
        return _cpu_seconds() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="a permits database URL (sqlite:///..., mysql://..., postgresql://...)")
    parser.add_argument("--cycles", type=int, default=3000, help="measured cycles (as many again to warm up)")
    parser.add_argument("--asyncio", action="store_true", help="the asyncio client (connect_async), on one loop")
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="switch callgrind's instrumentation on once connected (client_instructions.py runs it so)",
    )
    args = parser.parse_args()
    if args.asyncio:
        cpu, wall = asyncio.run(_measure_async(args.url, args.cycles, args.callgrind))
    else:
        cpu, wall = _measure_sync(args.url, args.cycles, args.callgrind)
    print(
        f"{args.cycles / wall:.0f} cycles/s, client CPU {cpu / args.cycles * 1000:.3f} ms/cycle,"
        f" wall {wall / args.cycles * 1000:.3f} ms/cycle"
    )


if __name__ == "__main__":
    main()
