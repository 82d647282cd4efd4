#!/usr/bin/env python3
"""Run the benchmark matrix and write it up as markdown (docs/benchmarks.md).

    python benchmarks/report.py --out docs/benchmarks.md      # full: ~25 minutes on 2 cores
    python benchmarks/report.py --quick                         # CI: under 2 minutes, to stdout

Three systems on each backend, in one run on one machine:
- ``floor``: one conditional UPDATE to take a permit and one to give it back, each in autocommit;
- ``seed``: the design of shared/seeds/001 as written (SELECT FOR UPDATE, SUM, two INSERTs; release as
  two UPDATEs);
- ``permits``: the library, with every guarantee on.
Each at 1, 4 and 16 client processes, ``hot`` (one semaphore of capacity 10) and ``spread`` (one each),
then again with old released rows already in the tables.

Then, on MariaDB and PostgreSQL, the hot semaphore through the HTTP service (``permits serve``) with its
pre-lock on and off, beside the library talking to the database directly, at 1, 16 and 64 clients: what
the pre-lock does to throughput, latency and the database connections the service keeps busy.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import RunResult, default_url, describe_machine, run

SYSTEMS = {
    "floor": "floor",
    "seed": "seed",
    "permits": "systems:PERMITS",
    "service+prelock": "service_system:PRELOCK_ON",
    "service-prelock": "service_system:PRELOCK_OFF",
}
SERVICE_SYSTEMS = ("permits", "service+prelock", "service-prelock")


@dataclass(frozen=True)
class Plan:
    backends: tuple[str, ...]
    clients: tuple[int, ...]
    seconds: float
    history: int
    history_clients: tuple[int, ...]
    service_clients: tuple[int, ...]


FULL = Plan(("sqlite", "mariadb", "postgresql"), (1, 4, 16), 5.0, 1_000_000, (1, 16), (1, 16, 64))
QUICK = Plan(("sqlite", "mariadb", "postgresql"), (1, 4), 1.0, 10_000, (1,), (4,))


def _run(system: str, backend: str, scenario: str, clients: int, plan: Plan, history: int = 0) -> RunResult:
    result = run(SYSTEMS[system], default_url(backend), scenario, clients, plan.seconds, history=history)
    label = f"{system:8} {backend:10} {scenario:6} {clients:3} clients history={history:<8}"
    print(f"{label} {result.cycles_per_s:9.0f} cycles/s  errors={result.error_count}", file=sys.stderr)
    return result


def _ratio(value: float, floor: float) -> str:
    return f"{value / floor:.2f}x" if floor else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short runs, small history: the CI smoke test")
    parser.add_argument("--backends", default=None, help="comma-separated subset of sqlite,mariadb,postgresql")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here (default: stdout)")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.backends:
        plan = Plan(
            tuple(args.backends.split(",")),
            plan.clients,
            plan.seconds,
            plan.history,
            plan.history_clients,
            plan.service_clients,
        )

    started = time.monotonic()
    results: dict[tuple[str, str, str, int, int], RunResult] = {}
    for backend in plan.backends:
        for scenario in ("hot", "spread"):
            for clients in plan.clients:
                for system in ("floor", "seed", "permits"):
                    results[(system, backend, scenario, clients, 0)] = _run(system, backend, scenario, clients, plan)
            for clients in plan.history_clients:
                for system in ("seed", "permits"):
                    key = (system, backend, scenario, clients, plan.history)
                    results[key] = _run(system, backend, scenario, clients, plan, plan.history)

    for backend in plan.backends:
        if backend == "sqlite":
            continue  # one machine, one file: the service is for the servers
        for clients in plan.service_clients:
            for system in SERVICE_SYSTEMS:
                key = (system, backend, "hot", clients, 0)
                if key not in results:
                    results[key] = _run(system, backend, "hot", clients, plan)

    errors = [(k, r) for k, r in results.items() if r.error_count]
    text = _markdown(plan, results, args, time.monotonic() - started)
    if args.out:
        args.out.write_text(_keep_findings(args.out, text))
    else:
        print(text)
    for key, r in errors:
        print(f"errors in {key}: {r.errors[:3]}", file=sys.stderr)
    # The baselines' errors are data about them (the floor and the seed's design have no busy handling on
    # SQLite); an error in permits itself fails the run.
    return 1 if any(key[0] in SERVICE_SYSTEMS for key, _ in errors) else 0


def _markdown(plan: Plan, results: dict[tuple[str, str, str, int, int], RunResult], args: object, took: float) -> str:
    command = "python benchmarks/report.py" + (" --quick" if plan is QUICK else " --out docs/benchmarks.md")
    lines = [
        "# Benchmarks",
        "",
        "Acquire+release cycles per second (granted cycles only) and per-cycle latency, with every client a",
        "separate process looping for a fixed time. All systems ran in the same run, on the same machine.",
        "",
        f"- Command: `{command}` (took {took / 60:.0f} min)",
        f"- Machine: {describe_machine([default_url(b) for b in plan.backends if b != 'sqlite'])}",
        f"- Each run: {plan.seconds:g} s after every client connected; `hot` = one semaphore of capacity 10",
        "  shared by all clients, `spread` = one semaphore of capacity 10 per client.",
        "- `floor`: one conditional `UPDATE ... SET used = used + 1 WHERE name = ? AND used + 1 <= capacity`",
        "  and its decrement, each in autocommit, with the same driver. Not a lock service: no lease, no TTL,",
        "  no token, no idempotency. It is the cost of two durable single-row writes.",
        "- `seed`: the design of shared/seeds/001 (Part 4-5) as written: idempotency SELECT, SELECT ... FOR",
        "  UPDATE, SUM over permit rows, two INSERTs, COMMIT; release as a SELECT and two UPDATEs.",
        "- `permits`: the library's sync client, `try_acquire` then `release`, every guarantee on.",
        "- Durability is on everywhere: SQLite WAL with `synchronous=FULL`; MariaDB",
        "  `innodb_flush_log_at_trx_commit=1`; PostgreSQL `synchronous_commit=on`.",
        "",
    ]
    for backend in plan.backends:
        lines += [f"## {backend}", ""]
        lines += [
            "| scenario | clients | floor c/s | seed c/s | seed / floor | permits c/s | permits / floor "
            "| permits p50 ms | permits p99 ms | seed p99 ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for scenario in ("hot", "spread"):
            for clients in plan.clients:
                floor = results[("floor", backend, scenario, clients, 0)]
                seed = results[("seed", backend, scenario, clients, 0)]
                ours = results[("permits", backend, scenario, clients, 0)]
                lines.append(
                    f"| {scenario} | {clients} | {floor.cycles_per_s:.0f} | {seed.cycles_per_s:.0f} "
                    f"| {_ratio(seed.cycles_per_s, floor.cycles_per_s)} | {ours.cycles_per_s:.0f} "
                    f"| {_ratio(ours.cycles_per_s, floor.cycles_per_s)} | {_ms(ours.p50_ms)} | {_ms(ours.p99_ms)} "
                    f"| {_ms(seed.p99_ms)} |"
                )
        lines += [
            "",
            f"With {plan.history:,} old released rows in the tables (cycles/s, and the change from an empty",
            "history):",
            "",
            "| scenario | clients | seed | seed change | permits | permits change |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for scenario in ("hot", "spread"):
            for clients in plan.history_clients:
                row = [f"| {scenario} | {clients}"]
                for system in ("seed", "permits"):
                    empty = results[(system, backend, scenario, clients, 0)].cycles_per_s
                    full = results[(system, backend, scenario, clients, plan.history)].cycles_per_s
                    change = f"{(full - empty) / empty * 100:+.0f}%" if empty else "-"
                    row.append(f"{full:.0f} | {change}")
                lines.append(" | ".join(row) + " |")
        lines.append("")
    service_backends = [b for b in plan.backends if b != "sqlite"]
    if service_backends:
        lines += [
            "## Through the service: the pre-lock",
            "",
            "The hot semaphore (capacity 10) through one `permits serve` process, with its in-memory pre-lock",
            "on and off, beside the library talking to the database directly. Every client is a process of its",
            "own with the sync client; through the service each cycle is two HTTP requests. `db conns` is the",
            "number of database connections the service had checked out, sampled every 0.1 s (mean / max);",
            "`queued` the requests waiting in its pre-lock (mean).",
            "",
        ]
        for backend in service_backends:
            lines += [
                f"### {backend}",
                "",
                "| clients | system | cycles/s | p50 ms | p99 ms | db conns mean / max | queued |",
                "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
            ]
            for clients in plan.service_clients:
                for system in SERVICE_SYSTEMS:
                    r = results[(system, backend, "hot", clients, 0)]
                    conns = r.samples.get("permits_db_connections_in_use")
                    queued = r.samples.get("permits_prelock_waiting")
                    waiting = "-" if queued is None else f"{queued['mean']:.1f}"
                    lines.append(
                        f"| {clients} | {system} | {r.cycles_per_s:.0f} | {_ms(r.p50_ms)} | {_ms(r.p99_ms)} "
                        f"| {_pair(conns)} | {waiting} |"
                    )
            lines.append("")
    return "\n".join(lines) + "\n"


FINDINGS = ("<!-- findings: written by hand, kept by report.py -->", "<!-- /findings -->")


def _keep_findings(path: Path, text: str) -> str:
    """Put the hand-written findings of the previous file (between the FINDINGS markers) back after the
    title, so that a new run replaces the tables and keeps the reading of them for a person to update."""
    try:
        old = path.read_text()
    except OSError:
        return text
    start, end = old.find(FINDINGS[0]), old.find(FINDINGS[1])
    if start < 0 or end < start:
        return text
    block = old[start : end + len(FINDINGS[1])]
    title, _, rest = text.partition("\n\n")
    return f"{title}\n\n{block}\n\n{rest}"


def _pair(sample: dict[str, float] | None) -> str:
    return "-" if sample is None else f"{sample['mean']:.1f} / {sample['max']:.0f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
