#!/usr/bin/env python3
"""Run the benchmark matrix and write it up as markdown (docs/benchmarks.md) with PNG charts beside it.

    python benchmarks/report.py --out docs/benchmarks.md      # full: ~40 minutes on 2 cores
    python benchmarks/report.py --quick                         # CI: under 2 minutes, to stdout

Five systems on each backend, in one run on one machine:
- ``floor``: one conditional UPDATE to take a permit and one to give it back, each in autocommit;
- ``lease-floor``: the floor plus the one keyed, fenced, expiring lease row that any design with permits'
  guarantees must write (benchmarks/baselines.py);
- ``seed``: the design of shared/seeds/001 as written (SELECT FOR UPDATE, SUM, two INSERTs; release as
  two UPDATEs);
- ``permits``: the library, with every guarantee on; ``permits-fair``, the same on fair semaphores.
Each at 1, 4 and 16 client processes (and 64 on the hot semaphore), ``hot`` (one semaphore of capacity
10), ``spread`` (one each) and ``hotx3`` (three shared semaphores taken together by every acquire), then
again with old released rows already in the tables.

Then, on MariaDB and PostgreSQL, the hot semaphore through the HTTP service (``permits serve``) with its
pre-lock on and off, beside the library talking to the database directly, at 1, 16 and 64 clients: what
the pre-lock does to throughput, latency and the database connections the service keeps busy.

Then the peers (benchmarks/peers.py): the SQL servers' own session locks and tooz on them, shown in their
backend's tables, and Redis, ZooKeeper and etcd locks and semaphores, shown in a section of their own
beside permits on each backend. ZooKeeper and etcd are started privately when none is reachable.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import RunResult, Scenario, default_url, describe_machine, ensure_database, ensure_max_connections, run
from peers import PEERS, store_versions

SYSTEMS = {
    "floor": "floor",
    "lease-floor": "lease-floor",
    "seed": "seed",
    "permits": "systems:PERMITS",
    "permits-fair": "systems:PERMITS_FAIR",
    "service+prelock": "service_system:PRELOCK_ON",
    "service-prelock": "service_system:PRELOCK_OFF",
    "service-lean": "service_system:PRELOCK_ON_LEAN",
    "null-http": "http_floor:HTTP_FLOOR",
    "null-http-lean": "http_floor:LEAN_HTTP_FLOOR",
    **{name: f"peers:{name.upper().replace('-', '_')}" for name in PEERS},
}
BASELINES = ("floor", "lease-floor", "seed", "permits", "permits-fair")
#: run on the hot semaphore only: it is there to show what arrival order costs and gives under contention
HOT_ONLY = {"permits-fair"}
#: one semaphore per acquire only
SINGLE_ONLY = {"lease-floor"}
SERVICE_SYSTEMS = ("permits", "service+prelock", "service-prelock", "service-lean", "null-http", "null-http-lean")
#: the HTTP floors touch no database: each runs once per client count, whatever the backend
NULL_HTTP = ("null-http", "null-http-lean")
# Whether an acquire is on disk (synced) before it returns; see the peers' module docstring.
DURABLE = {"floor": True, "lease-floor": True, "seed": True, "permits": True, "permits-fair": True} | {
    name: peer.durable for name, peer in PEERS.items()
}
SQL_BACKENDS = ("sqlite", "mariadb", "postgresql")
# Store-agnostic peers ignore the benchmark's database; the harness still wants one, and SQLite's is a file.
STORE_PEER_URL = default_url("sqlite")

Key = tuple[str, str, str, int, int]  # system, backend (or the peer's own store), scenario label, clients, history
#: The history of a run with no old rows that ran just before its history twin (see main()).
TWIN = -1


@dataclass(frozen=True)
class Grid:
    """One scenario and the client counts it runs at."""

    scenario: str
    clients: tuple[int, ...]
    per_acquire: int = 1

    def at(self, clients: int) -> Scenario:
        return Scenario(self.scenario, clients, per_acquire=self.per_acquire)

    @property
    def label(self) -> str:
        return self.at(1).label


@dataclass(frozen=True)
class Plan:
    backends: tuple[str, ...]
    grids: tuple[Grid, ...]  # floor, seed and permits on every backend
    seconds: float
    history: int
    history_clients: tuple[int, ...]
    service_clients: tuple[int, ...]
    peer_grids: tuple[Grid, ...]
    charts: bool
    #: uncounted seconds before each measured run (see harness._loop)
    warmup: float = 0.0


FULL = Plan(
    backends=SQL_BACKENDS,
    grids=(Grid("hot", (1, 4, 16, 64)), Grid("spread", (1, 4, 16)), Grid("hot", (1, 4, 16), per_acquire=3)),
    seconds=5.0,
    history=1_000_000,
    history_clients=(1, 16),
    service_clients=(1, 16, 64),
    peer_grids=(Grid("hot", (1, 4, 16, 64)), Grid("spread", (1, 4, 16))),
    charts=True,
    warmup=1.0,
)
QUICK = Plan(
    backends=SQL_BACKENDS,
    # hotx3 at one client only: it proves the all-or-nothing path runs on every backend, within CI's budget.
    grids=(Grid("hot", (1, 4)), Grid("spread", (4,)), Grid("hot", (1,), per_acquire=3)),
    seconds=0.3,
    history=2_000,
    history_clients=(1,),
    service_clients=(4,),
    peer_grids=(Grid("hot", (1, 4)),),
    charts=False,
)
SCENARIO_TITLES = {
    "hot": "hot: one semaphore of capacity 10 shared by all clients",
    "spread": "spread: one semaphore of capacity 10 per client",
    "hotx3": "hotx3: three shared semaphores of capacity 10, taken together by every acquire",
}


def _run(system: str, backend_url: str, scenario: Scenario, plan: Plan, history: int = 0) -> RunResult:
    try:
        result = run(
            SYSTEMS[system], backend_url, scenario, scenario.clients, plan.seconds, history=history, warmup=plan.warmup
        )
    except Exception as exc:  # a system whose setup fails is reported (and fails the report), not fatal
        result = RunResult(system, "-", scenario.label, scenario.clients, plan.seconds)
        result.errors, result.error_count = [f"setup failed: {type(exc).__name__}: {exc}"], 1
    label = f"{system:19} {result.backend:10} {scenario.label:6} {scenario.clients:3} clients history={history:<8}"
    print(f"{label} {result.cycles_per_s:9.0f} cycles/s  errors={result.error_count}", file=sys.stderr)
    return result


def _did_not_start(result: RunResult) -> bool:
    first_lines = [message.split("\n", 1)[0] for message in result.errors]
    return any(
        line.startswith("setup failed") or line.endswith(("failed to start:", "did not connect in time; terminated"))
        for line in first_lines
    )


def _ratio(value: float, floor: float) -> str:
    return f"{value / floor:.2f}x" if floor else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short runs, small history: the CI smoke test")
    parser.add_argument("--backends", default=None, help="comma-separated subset of sqlite,mariadb,postgresql")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here (default: stdout)")
    parser.add_argument(
        "--charts",
        type=Path,
        default=None,
        help="write the PNG charts here (default: beside --out, in a directory named after it; none in --quick)",
    )
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.backends:
        plan = replace(plan, backends=tuple(args.backends.split(",")))
    charts_dir = args.charts
    if charts_dir is None and plan.charts and args.out is not None:
        charts_dir = args.out.with_suffix("")  # docs/benchmarks.md -> docs/benchmarks/

    # The peers start private Redis, ZooKeeper and etcd servers from Debian's packages: install any missing
    # first, or their rows would be failures rather than figures.
    subprocess.run([str(Path(__file__).resolve().parent.parent / "scripts" / "ensure-peers")], check=True)
    if "postgresql" in plan.backends:
        # A client that waits holds two connections (its pool's and its LISTEN one), the service some more.
        ensure_database(default_url("postgresql"))  # a fresh server has no benchmark database yet
        ensure_max_connections(default_url("postgresql"), 2 * max(plan.service_clients + plan.grids[0].clients) + 60)
    started = time.monotonic()
    results: dict[Key, RunResult] = {}
    for backend in plan.backends:
        url = default_url(backend)
        for grid in plan.grids:
            for clients in grid.clients:
                for system in BASELINES:
                    if (system in HOT_ONLY and grid.label != "hot") or (system in SINGLE_ONLY and grid.per_acquire > 1):
                        continue
                    results[(system, backend, grid.label, clients, 0)] = _run(system, url, grid.at(clients), plan)
        for scenario in ("hot", "spread"):
            for clients in plan.history_clients:
                for system in ("seed", "permits"):
                    # Its empty-history twin runs just before it: on a shared VM, single cells drift by 20%
                    # from minute to minute, more than the 10% this comparison is about.
                    twin = (system, backend, scenario, clients, TWIN)
                    results[twin] = _run(system, url, Scenario(scenario, clients), plan)
                    key = (system, backend, scenario, clients, plan.history)
                    results[key] = _run(system, url, Scenario(scenario, clients), plan, plan.history)

    for backend in plan.backends:
        if backend == "sqlite":
            continue  # one machine, one file: the service is for the servers
        for clients in plan.service_clients:
            for system in SERVICE_SYSTEMS:
                key = (system, backend, "hot", clients, 0)
                done = [r for k, r in results.items() if k[0] == system and system in NULL_HTTP and k[3] == clients]
                if done:  # touches no database: once per client count is enough
                    results[key] = done[0]
                elif key not in results:
                    results[key] = _run(system, default_url(backend), Scenario("hot", clients), plan)

    for name, peer in PEERS.items():
        if peer.backend is not None and peer.backend not in plan.backends:
            continue
        url = default_url(peer.backend) if peer.backend else STORE_PEER_URL
        for grid in plan.peer_grids:
            for clients in grid.clients:
                results[(name, peer.store, grid.label, clients, 0)] = _run(name, url, grid.at(clients), plan)

    charts = _charts(plan, results, charts_dir) if charts_dir is not None else {}
    command = "python benchmarks/report.py " + " ".join(sys.argv[1:])
    took = time.monotonic() - started
    text = _markdown(plan, results, command.strip(), took, _chart_links(charts, charts_dir, args.out))
    if args.out:
        args.out.write_text(_keep_findings(args.out, text))
    else:
        print(text)
    errors = [(k, r) for k, r in results.items() if r.error_count]
    for key, r in errors:
        print(f"errors in {key}: {r.errors[:3]}", file=sys.stderr)
    # The baselines' and the peers' errors are data about them (the floor and the seed's design have no
    # busy handling on SQLite); an error in permits itself fails the run, and so does any system that
    # could not start at all (a peer's server unreachable, a library missing).
    failed = [key for key, r in errors if key[0] in SERVICE_SYSTEMS or _did_not_start(r)]
    return 1 if failed else 0


def _chart_links(
    charts: dict[tuple[str, str], str], directory: Path | None, out: Path | None
) -> dict[tuple[str, str], str]:
    """The charts' paths as the markdown links them: relative to the markdown file when they are beside it."""
    if directory is None:
        return {}
    base = directory.resolve()
    if out is not None and base.is_relative_to(out.parent.resolve()):
        base = base.relative_to(out.parent.resolve())
    return {key: f"{base.as_posix()}/{name}" for key, name in charts.items()}


# --------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------


def _markdown(
    plan: Plan, results: dict[Key, RunResult], command: str, took: float, charts: dict[tuple[str, str], str]
) -> str:
    peers_present = sorted({key[1] for key in results if key[0] in PEERS and key[1] not in SQL_BACKENDS})
    lines = [
        "# Benchmarks",
        "",
        "Acquire+release cycles per second (granted cycles only) and per-cycle latency, with every client a",
        "separate process looping for a fixed time. All systems ran in the same run, on the same machine.",
        "",
        f"- Command: `{command}` (took {took / 60:.0f} min)",
        f"- Machine: {describe_machine([default_url(b) for b in plan.backends if b != 'sqlite'])}",
        *([f"- Peers' own stores: {_store_versions()}"] if peers_present else []),
        f"- Each run: {plan.seconds:g} s, counted after every client connected and then cycled for"
        f" {plan.warmup:g} s uncounted (every system alike); `hot` = one semaphore of capacity 10",
        "  shared by all clients, `spread` = one semaphore of capacity 10 per client, `hotx3` = three shared",
        "  semaphores of capacity 10, one permit of each taken together (all or nothing) by every acquire.",
        "- `floor`: one conditional `UPDATE ... SET used = used + 1 WHERE name = ? AND used + 1 <= capacity`",
        "  and its decrement, each in autocommit, with the same driver (in `hotx3`: three of each, each three",
        "  in one transaction). Not a lock service: no lease, no TTL, no token, no idempotency. It is the cost",
        "  of two durable single-row writes.",
        "- `lease-floor`: the least a lease service with permits' guarantees writes: the floor's conditional",
        "  UPDATE, also raising the fencing token, and in the same transaction one lease row keyed by (owner,",
        "  key) with its token and an expiry on the database's clock; release deletes the row and gives the",
        "  permit back. One request each way on the raw driver (a CTE on PostgreSQL, a multi-statement batch",
        "  on MariaDB). It keeps no history and no fair queue and validates nothing: the distance between it",
        "  and `floor` is what recording a lease costs any design, on that engine.",
        "- `seed`: the design of shared/seeds/001 (Parts 3-5) as written: idempotency SELECT; BEGIN and the",
        "  seed's lock-timeout SET (on MariaDB, reset before COMMIT); SELECT ... FOR UPDATE (SQLite: BEGIN",
        "  IMMEDIATE); SUM over permit rows; two INSERTs; COMMIT. Release: a SELECT and two UPDATEs.",
        "- `permits`: the library's sync client, `acquire` (waiting for room as `with client.lease(...)` does,",
        "  up to 5 s) then `release`, every guarantee on. `permits-fair`: the same on fair semaphores.",
        "- Peers: other ways to share a capacity, each used as its documentation shows with its non-blocking",
        "  acquire (benchmarks/peers.py). Most are mutexes: for those a semaphore of capacity 10 is 10 slot",
        "  locks, which a client tries in turn from slot (client index mod 10), so a refusal costs up to 10",
        "  round trips. `pg-advisory`: `pg_try_advisory_lock` / `pg_advisory_unlock`; `mariadb-get-lock`:",
        "  `GET_LOCK(name, 0)` / `RELEASE_LOCK`; `tooz-*`: tooz's coordinator and `get_lock`, which opens a",
        "  connection per try; `redis-lua-semaphore`: a sorted set of holders with TTL cleanup, one EVALSHA to",
        "  acquire and one ZREM to release; `redis-py-lock`: redis-py's `Lock`; `python-redis-lock`:",
        "  `redis_lock.Lock`; `kazoo-semaphore`: kazoo's `Semaphore(max_leases=10)` on ZooKeeper, whose",
        "  inner lock refuses a non-blocking try that meets another client; `kazoo-lock`: kazoo's `Lock`;",
        "  `etcd3gw-lock`: etcd3gw's `Lock` through etcd's v3 JSON gateway (a lease and a compare-and-put).",
        "- `durable`: the grant is on disk (synced) before the acquire returns, so it survives the store's",
        "  crash. Session locks held in a server's memory (advisory locks, GET_LOCK, tooz on them) and Redis",
        "  are not. Durability is on everywhere it exists: SQLite WAL with `synchronous=FULL`; MariaDB",
        "  `innodb_flush_log_at_trx_commit=1`; PostgreSQL `synchronous_commit=on`; ZooKeeper `forceSync`;",
        "  etcd's synced log.",
        "- `jain`: Jain's fairness index over the clients' granted cycles: 1.00 when every client got the",
        "  same share, 1/clients when one got everything. `refused`: the share of tries that found no room.",
        "  `errors`: failed cycles, and clients that crashed.",
        "- `CPU ms/cycle`: the CPU time used per granted cycle over the counted seconds (benchmarks/harness.py,",
        "  `RunResult.cpu`): by all the clients, each counting its own process's, and by every database and",
        "  peer-store server process on the machine (postgres, mariadbd, redis-server, etcd, ZooKeeper's JVM;",
        "  idle ones add little). SQLite runs inside the clients, so its work is theirs. `cores`: the CPU the",
        f"  whole machine had in use then, of its {os.cpu_count()}; where it is near that, the cell",
        "  was bound by CPU, and a system's CPU per cycle bounds its throughput.",
        "",
    ]
    lines += _targets_section(plan, results)
    for backend in plan.backends:
        lines += [f"## {backend}", ""]
        for label in _labels(plan.grids):
            lines += _scenario_table(plan, results, backend, label, charts.get((backend, label)))
        lines += _history_table(plan, results, backend)
    lines += _service_section(plan, results)
    lines += _peer_section(plan, results, charts)
    return "\n".join(lines) + "\n"


def _targets_section(plan: Plan, results: dict[Key, RunResult]) -> list[str]:
    """Issue 5's targets, each as measured in this run: what was asked, the figure, and whether it holds."""

    def get(system: str, backend: str, scenario: str, clients: int, history: int = 0) -> RunResult | None:
        return results.get((system, backend, scenario, clients, history))

    rows: list[tuple[str, str, bool]] = []
    servers = [b for b in plan.backends if b != "sqlite"]
    for backend in servers:
        for scenario in ("hot", "spread"):
            for clients in (1, 16):
                mine, floor = get("permits", backend, scenario, clients), get("floor", backend, scenario, clients)
                if mine and floor and floor.cycles_per_s:
                    ratio = mine.cycles_per_s / floor.cycles_per_s
                    # The lease floor beside it: how much of the distance any design that records a keyed,
                    # fenced, expiring lease must pay.
                    leased = get("lease-floor", backend, scenario, clients)
                    beside = f" (lease floor {leased.cycles_per_s / floor.cycles_per_s:.2f}x)" if leased else ""
                    rows.append(
                        (
                            f"{backend} {scenario} {clients} clients: permits / floor >= 0.7",
                            f"{ratio:.2f}x{beside}",
                            ratio >= 0.7,
                        )
                    )
    for backend in plan.backends:
        for scenario in ("hot", "spread"):
            for clients in plan.history_clients:
                empty, full = (
                    get("permits", backend, scenario, clients, TWIN) or get("permits", backend, scenario, clients),
                    get("permits", backend, scenario, clients, plan.history),
                )
                if empty and full and empty.cycles_per_s:
                    change = (full.cycles_per_s - empty.cycles_per_s) / empty.cycles_per_s
                    rows.append(
                        (
                            f"{backend} {scenario} {clients} clients: {plan.history:,} old rows cost < 10%",
                            f"{change * 100:+.0f}%",
                            change > -0.10,
                        )
                    )
    durable_peers = [name for name in ("seed", *PEERS) if DURABLE.get(name)]
    for backend in plan.backends:
        for clients in _clients(plan.grids, "hot"):
            mine = get("permits", backend, "hot", clients)
            if mine is None:
                continue
            rivals = []
            for peer in durable_peers:
                store = backend if peer == "seed" else PEERS[peer].store
                r = get(peer, store, "hot", clients)
                if r is not None:
                    rivals.append((r.cycles_per_s, peer))
            if rivals:
                best, name = max(rivals)
                # The lease floor beside it: whether any design that records a keyed, expiring lease row on
                # this backend was ahead of that peer in this run.
                leased = get("lease-floor", backend, "hot", clients)
                beside = f"; lease floor {leased.cycles_per_s:.0f}" if leased else ""
                rows.append(
                    (
                        f"{backend} hot {clients} clients: ahead of every durable peer",
                        f"{mine.cycles_per_s:.0f} vs {best:.0f} ({name}){beside}",
                        mine.cycles_per_s > best,
                    )
                )
    top = max(plan.service_clients)
    lua = next((r for k, r in results.items() if k[0] == "redis-lua-semaphore" and k[2] == "hot" and k[3] == top), None)
    http = get("null-http", servers[0], "hot", top) if servers else None
    lean_http = get("null-http-lean", servers[0], "hot", top) if servers else None
    for backend in servers:
        service = get("service+prelock", backend, "hot", top)
        lean = get("service-lean", backend, "hot", top)
        if (service or lean) and lua:
            # The target is the service's: with the leanest client too, so that the Python client's cost
            # is not counted against it. The null services bound what one service process can do here.
            best = max(r.cycles_per_s for r in (service, lean) if r)
            measured = f"{service.cycles_per_s:.0f}" if service else "-"
            measured += f" (lean client: {lean.cycles_per_s:.0f})" if lean else ""
            bounds = [f"{r.cycles_per_s:.0f}{label}" for r, label in ((http, ""), (lean_http, " lean")) if r]
            bound = f"; the null HTTP service: {' / '.join(bounds)}" if bounds else ""
            budget = _service_budget_ms(lua.cycles_per_s, lean)
            if budget is not None and lean is not None:
                spent = lean.cpu_ms_per_cycle("server")
                bare = lean_http.cpu_ms_per_cycle("server") if lean_http else None
                bound += (
                    f"; at {lua.cycles_per_s:.0f} cycles/s the service's CPU budget is {budget:.2f} ms a cycle"
                    f" (spent: {_ms(spent)}; a bare ASGI app: {_ms(bare)})"
                )
            rows.append(
                (
                    f"{backend}: service at {top} clients >= the Redis Lua semaphore",
                    f"{measured} vs {lua.cycles_per_s:.0f}{bound}",
                    best >= lua.cycles_per_s,
                )
            )
        if service and service.samples.get("rss_mb"):
            rss = service.samples["rss_mb"]["max"]
            rows.append((f"{backend}: service resident memory at {top} clients < 150 MB", f"{rss:.0f} MB", rss < 150))
    hot = _clients(plan.grids, "hot")
    if 4 in hot and max(hot) > 4:
        many = max(hot)
        for backend in plan.backends:
            for system in ("permits", "permits-fair"):
                four, lots = get(system, backend, "hot", 4), get(system, backend, "hot", many)
                if four and lots and four.cycles_per_s:
                    ratio = lots.cycles_per_s / four.cycles_per_s
                    rows.append(
                        (
                            f"{backend} {system}: {many} clients >= 0.4x 4 clients, Jain >= 0.9",
                            f"{ratio:.2f}x, Jain {lots.fairness:.2f}",
                            ratio >= 0.4 and lots.fairness >= 0.9,
                        )
                    )
    if not rows:
        return []
    lines = [
        "## Targets",
        "",
        "Issue 5's targets, each computed from this run's figures (the tables below).",
        "",
        "| target | measured | met |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {what} | {figure} | {'yes' if met else '**no**'} |" for what, figure, met in rows]
    return [*lines, ""]


def _service_budget_ms(rate: float, lean: RunResult | None) -> float | None:
    """The CPU a service process could spend per cycle at ``rate`` cycles/s, with every core of the machine
    busy: what the cores give per cycle, less what the lean clients and the database spent per cycle
    through the service (``lean``). At or below 0, no service could reach ``rate`` on this machine with
    these clients and this database, whatever it did. None: not measured."""
    clients, stores = (lean.cpu_ms_per_cycle(part) for part in ("clients", "stores")) if lean else (None, None)
    if clients is None or stores is None or rate <= 0:
        return None
    return (os.cpu_count() or 1) * 1000 / rate - clients - stores


def _labels(grids: tuple[Grid, ...]) -> list[str]:
    return list(dict.fromkeys(grid.label for grid in grids))


def _clients(grids: tuple[Grid, ...], label: str) -> list[int]:
    return sorted({c for grid in grids if grid.label == label for c in grid.clients})


def _yes_no(system: str) -> str:
    return "yes" if DURABLE.get(system) else "no"


def _refused(r: RunResult) -> str:
    tries = r.granted + r.refused
    return f"{r.refused / tries:.0%}" if tries else "-"


def _jain(r: RunResult) -> str:
    return f"{r.fairness:.2f}" if r.clients > 1 else "-"


def _scenario_table(
    plan: Plan, results: dict[Key, RunResult], backend: str, label: str, chart: str | None
) -> list[str]:
    """Every system that ran on ``backend`` in scenario ``label``, grouped by client count."""
    lines = [f"### {SCENARIO_TITLES.get(label, label)}", ""]
    if chart:
        lines += [f"![{backend}, {label}: cycles/s against clients]({chart})", ""]
    lines += [
        "| clients | system | durable | cycles/s | / floor | refused | p50 ms | p99 ms | jain | errors "
        "| CPU ms/cycle clients / database | cores |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    systems = [*BASELINES, *(name for name, peer in PEERS.items() if peer.store == backend)]
    for clients in _clients(plan.grids + plan.peer_grids, label):
        floor = results.get(("floor", backend, label, clients, 0))
        for system in systems:
            r = results.get((system, backend, label, clients, 0))
            if r is None:
                continue
            ratio = _ratio(r.cycles_per_s, floor.cycles_per_s) if floor else "-"
            lines.append(
                f"| {clients} | {system} | {_yes_no(system)} | {r.cycles_per_s:.0f} | {ratio} | {_refused(r)} "
                f"| {_ms(r.p50_ms)} "
                f"| {_ms(r.p99_ms)} | {_jain(r)} | {r.error_count} | {_cpu_parts(r, *BESIDE_STORE)} | {_cores(r)} |"
            )
    return [*lines, ""]


def _history_table(plan: Plan, results: dict[Key, RunResult], backend: str) -> list[str]:
    lines = [
        "### With old rows",
        "",
        f"With {plan.history:,} old released rows in the tables: cycles/s, beside the same run with an empty",
        "history just before it, and the change.",
        "",
        "| scenario | clients | seed empty | seed | seed change | permits empty | permits | permits change |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for scenario in ("hot", "spread"):
        for clients in plan.history_clients:
            row = [f"| {scenario} | {clients}"]
            for system in ("seed", "permits"):
                twin = results.get((system, backend, scenario, clients, TWIN))
                empty = (twin or results[(system, backend, scenario, clients, 0)]).cycles_per_s
                full = results[(system, backend, scenario, clients, plan.history)].cycles_per_s
                change = f"{(full - empty) / empty * 100:+.0f}%" if empty else "-"
                row.append(f"{empty:.0f} | {full:.0f} | {change}")
            lines.append(" | ".join(row) + " |")
    return [*lines, ""]


def _service_section(plan: Plan, results: dict[Key, RunResult]) -> list[str]:
    service_backends = [b for b in plan.backends if b != "sqlite"]
    if not service_backends:
        return []
    lines = [
        "## Through the service: the pre-lock",
        "",
        "The hot semaphore (capacity 10) through one `permits serve` process, with its in-memory pre-lock",
        "on and off, beside the library talking to the database directly. Every client is a process of its",
        "own with the sync client; through the service each cycle is two HTTP requests. `service-lean` is",
        "the service with its pre-lock, driven by the standard library's `http.client` instead, as a client",
        "in any language would (benchmarks/lean_http.py). `db conns` is the number of database connections",
        "the service had checked out, sampled every 0.1 s (mean / max); `queued` the requests waiting in its",
        "pre-lock (mean); `RSS MB` the service process's resident memory (mean / max). `null-http` is the",
        "same HTTP stack (uvicorn, FastAPI, the httpx client) with two endpoints that answer at once and",
        "touch no database: no service on this stack can do more cycles per second on this machine.",
        "`null-http-lean` is the leanest pair (a bare ASGI function on the same uvicorn, `http.client` in",
        "the clients): a practical ceiling for one service process on this machine, with light clients.",
        "`CPU ms/cycle` is the CPU time each part used per granted cycle over the counted seconds: the",
        "clients (all of them, each counting its own), the server (the one service process) and the database",
        "server's processes; `cores` is what the whole machine had in use then.",
        "",
    ]
    for backend in service_backends:
        lines += [
            f"### {backend}",
            "",
            "| clients | system | cycles/s | p50 ms | p99 ms | jain | db conns mean / max | queued | RSS MB "
            "| CPU ms/cycle clients / server / database | cores |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for clients in plan.service_clients:
            for system in SERVICE_SYSTEMS:
                r = results[(system, backend, "hot", clients, 0)]
                conns = r.samples.get("permits_db_connections_in_use")
                queued = r.samples.get("permits_prelock_waiting")
                waiting = "-" if queued is None else f"{queued['mean']:.1f}"
                lines.append(
                    f"| {clients} | {system} | {r.cycles_per_s:.0f} | {_ms(r.p50_ms)} | {_ms(r.p99_ms)} "
                    f"| {_jain(r)} | {_pair(conns)} | {waiting} | {_pair(r.samples.get('rss_mb'))} "
                    f"| {_cpu_parts(r, *THROUGH_SERVICE)} | {_cores(r)} |"
                )
        lines.append("")
    return lines


def _store_peers() -> list[str]:
    return [name for name, peer in PEERS.items() if peer.backend is None]


def _peer_section(plan: Plan, results: dict[Key, RunResult], charts: dict[tuple[str, str], str]) -> list[str]:
    """The peers that bring their own store (Redis, ZooKeeper, etcd), beside permits on each backend."""
    if not any(key[0] in _store_peers() for key in results):
        return []
    lines = [
        "## Peers on their own stores",
        "",
        "Redis, ZooKeeper and etcd locks and semaphores, run once each (they do not use the SQL backend),",
        "beside permits on each backend from the tables above (same run, same scenario). `CPU ms/cycle`: as",
        "in the service's tables, the clients' and the store's (its server's processes) per granted cycle.",
        "",
    ]
    for grid in plan.peer_grids:
        label = grid.label
        lines += [f"### {SCENARIO_TITLES.get(label, label)}", ""]
        if ("peers", label) in charts:
            lines += [f"![peers, {label}: cycles/s against clients]({charts[('peers', label)]})", ""]
        lines += [
            "| clients | system | store | durable | cycles/s | refused | p50 ms | p99 ms | jain | errors "
            "| CPU ms/cycle clients / store |",
            "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for clients in grid.clients:
            rows = [("permits", backend) for backend in plan.backends]
            rows += [(name, PEERS[name].store) for name in _store_peers()]
            for system, store in rows:
                r = results.get((system, store, label, clients, 0))
                if r is None:
                    continue
                lines.append(
                    f"| {clients} | {system} | {store} | {_yes_no(system)} | {r.cycles_per_s:.0f} | {_refused(r)} "
                    f"| {_ms(r.p50_ms)} | {_ms(r.p99_ms)} | {_jain(r)} | {r.error_count} "
                    f"| {_cpu_parts(r, *BESIDE_STORE)} |"
                )
        lines.append("")
    return lines


def _store_versions() -> str:
    try:
        return store_versions()
    except Exception as exc:  # the runs themselves report an unreachable store; this line only says so
        return f"unavailable ({type(exc).__name__}: {exc})"


# --------------------------------------------------------------------------
# Charts
# --------------------------------------------------------------------------


def _charts(plan: Plan, results: dict[Key, RunResult], directory: Path) -> dict[tuple[str, str], str]:
    """One PNG per backend and scenario (and one per scenario for the store peers): cycles/s against
    clients, one line per system. Returns the file name of each, keyed by (backend or "peers", scenario)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    charts: dict[tuple[str, str], str] = {}
    figures: list[tuple[str, str, list[tuple[str, str]]]] = []
    for backend in plan.backends:
        backend_peers = [(name, backend) for name, peer in PEERS.items() if peer.store == backend]
        for label in _labels(plan.grids):
            figures.append((backend, label, [(system, backend) for system in BASELINES] + backend_peers))
    for label in _labels(plan.peer_grids):
        lines = [("permits", backend) for backend in plan.backends]
        figures.append(("peers", label, lines + [(name, PEERS[name].store) for name in _store_peers()]))

    for group, label, series in figures:
        fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
        drawn: set[int] = set()
        for system, store in series:
            points = sorted(
                (key[3], r.cycles_per_s)
                for key, r in results.items()
                if key[:3] == (system, store, label) and key[4] == 0 and r.cycles_per_s > 0
            )
            if not points:
                continue
            name = f"{system} ({store})" if group == "peers" else system
            style = "-" if DURABLE.get(system) else "--"  # dashed: not durable
            width = 3 if system == "permits" else 1.5
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", linewidth=width, label=name)
            drawn.update(p[0] for p in points)
        if not drawn:
            plt.close(fig)
            continue
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(drawn), [str(c) for c in sorted(drawn)])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("client processes")
        ax.set_ylabel("granted cycles/s (log)")
        title = "peers on their own stores" if group == "peers" else group
        ax.set_title(f"{title}: {SCENARIO_TITLES.get(label, label)}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), title="dashed: not durable", title_fontsize=8)
        fig.tight_layout()
        filename = f"{group}-{label}.png"
        fig.savefig(directory / filename)
        plt.close(fig)
        charts[(group, label)] = filename
    return charts


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


#: The parts whose CPU per cycle a table shows: a system beside its store, and one through the service.
BESIDE_STORE = ("clients", "stores")
THROUGH_SERVICE = ("clients", "server", "stores")


def _cpu_parts(r: RunResult, *parts: str) -> str:
    """CPU ms per granted cycle of each of ``parts`` (``RunResult.cpu``), "-" where not measured."""
    per_cycle = [r.cpu_ms_per_cycle(part) for part in parts]
    if all(ms is None for ms in per_cycle):
        return "-"
    return " / ".join("-" if ms is None else f"{ms:.2f}" for ms in per_cycle)


def _cores(r: RunResult) -> str:
    return f"{r.cpu['all']:.2f}" if "all" in r.cpu else "-"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
