"""The benchmark suite in quick mode, so that it cannot rot: every system runs on every backend, through
the service too, every peer runs, and permits itself reports no error and no drift (figures are not
checked here: a timed test proves nothing on a shared machine; docs/benchmarks.md has the measured ones).

A peer whose store is unreachable or whose library is missing fails the report (and so this test): in CI
that is a broken setup, not a reason to skip. Errors a peer's library raises while it runs are data about
it and do not fail the report, but at 1 and 4 clients none of them should raise any."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import default_url  # noqa: E402 - benchmarks/ is not a package
from peers import PEERS  # noqa: E402

from tests._pgbouncer import pgbouncer_version  # noqa: E402
from tests.conftest import SERVER_URLS  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(900)  # the subprocess's own limit: the quick run takes under 2 minutes, more on a busy machine
def test_quick_benchmark_runs_every_system() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for heading in (
        "## sqlite",
        "## mariadb",
        "## postgresql",
        "## Through the service: the pre-lock",
        "## Peers on their own stores",
        "### hotx3",
    ):
        assert heading in done.stdout
    for system in ("service+prelock", "service-prelock", "service-lean", "null-http", "null-http-lean"):
        assert f"| {system} |" in done.stdout
    # Where the CPU went, per part, in every cell through the service (the clients, the service process, the
    # database's processes), and the clients' and the store's in every peer's. A server's time is read in
    # clock ticks (10 ms), which a quick run's 0.3 s may not fill: only the clients' must be above 0.
    rows = _table_rows(done.stdout)
    for row in (r for r in rows if r.get("system") == "service-lean"):
        clients, server, database = (float(ms) for ms in row["CPU ms/cycle clients / server / database"].split(" / "))
        assert clients > 0 and server >= 0 and database >= 0, row
    for peer in PEERS:
        mine = [r for r in rows if r.get("system") == peer]
        assert mine, f"{peer} is missing from the report"
        for row in mine:
            assert row["errors"] == "0", f"{peer} had errors: {row}"
            if "CPU ms/cycle clients / store" in row:
                clients, store = (float(ms) for ms in row["CPU ms/cycle clients / store"].split(" / "))
                assert clients > 0 and store >= 0, row
        if PEERS[peer].backend is None:  # a peer on its own store: its table has the CPU column
            assert any("CPU ms/cycle clients / store" in r for r in mine), f"{peer}: no CPU figures"
    # Each "ahead of every durable peer" target names the run's lease floor beside the best peer: whether a
    # design that writes a keyed, expiring lease row was ahead of that peer at all.
    ahead = [r for r in rows if r.get("target", "").endswith("ahead of every durable peer")]
    assert ahead and all("; lease floor " in r["measured"] for r in ahead), ahead


def _table_rows(report: str) -> list[dict[str, str]]:
    """Every row of every markdown table in ``report``, by its table's column names."""
    rows: list[dict[str, str]] = []
    header: list[str] | None = None
    for line in report.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not all(set(cell) <= set("-: ") for cell in cells):
            rows.append(dict(zip(header, cells, strict=True)))
    return rows


def test_the_notify_cost_measurement_runs() -> None:
    """benchmarks/notify_cost.py, behind the PostgreSQL notification figures in docs/benchmarks.md."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "notify_cost.py"),
            *("--url", SERVER_URLS["postgresql"], "--listeners", "0,2", "--seconds", "0.3"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len([line for line in done.stdout.splitlines() if line.endswith(" ms")]) == 2, done.stdout


def _run_script(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_statement_and_client_cost_measurements_run() -> None:
    """benchmarks/statement_cost.py and client_cpu.py, behind the single-client figures in
    docs/benchmarks.md. They run on the benchmark's own database, whose tables statement_cost.py drops."""
    url = default_url("postgresql")
    out = _run_script("statement_cost.py", url, "--cycles", "40", "--rounds", "1")
    assert [line.split("  ")[0] for line in out.splitlines()] == [
        "floor",
        "permits statements",
        "queued grant",
        "unprepared",
        "server functions",
    ], out
    assert all(line.endswith(" ms/cycle") for line in out.splitlines()), out
    out = _run_script("client_cpu.py", url, "--cycles", "40")
    assert "client CPU" in out and out.rstrip().endswith("ms/cycle"), out


@pytest.mark.beside_others  # it counts instructions, which other tests' load does not change
@pytest.mark.slow
def test_the_instruction_count_runs(tmp_path: Path) -> None:
    """benchmarks/client_instructions.py, behind "a connection kept for the statements that run
    alone" in docs/benchmarks.md: two short
    runs under valgrind, on a SQLite file of its own."""
    out = _run_script("client_instructions.py", f"sqlite:///{tmp_path}/count.db", "--few", "2", "--many", "6")
    found = re.fullmatch(r"installed permits: ([\d,]+) instructions per cycle\n", out)
    assert found is not None, out
    assert int(found.group(1).replace(",", "")) > 10_000, out  # a cycle of the library is never less


def _cycles_without_errors(system: str, backend: str, clients: str) -> None:
    """Runs ``system`` briefly through the harness, hot semaphore: every cell cycled, with no errors (the
    harness also checks that nothing is left in use)."""
    out = _run_script(
        "harness.py",
        *("--system", system, "--backend", backend, "--scenario", "hot"),
        *("--clients", clients, "--seconds", "0.5", "--warmup", "0", "--no-machine"),
    )
    # system backend scenario clients cycles/s refused p50 p99 max jain errors history load
    rows = [line.split() for line in out.splitlines() if line.startswith(system)]
    assert len(rows) == len(clients.split(",")), out
    for row in rows:
        assert row[-3] == "0" and float(row[4]) > 0, out


def test_the_harness_counts_the_cpu_of_each_part() -> None:
    """``--cpu``: the CPU time of the clients, of the server a system started (here the service) and of the
    database's processes, per granted cycle, over the counted seconds (docs/benchmarks.md)."""
    out = _run_script(
        "harness.py",
        *("--system", "service_system:PRELOCK_ON_LEAN", "--backend", "postgresql", "--scenario", "hot"),
        *("--clients", "2", "--seconds", "1", "--warmup", "0.2", "--no-machine", "--cpu"),
    )
    line = next((line.strip() for line in out.splitlines() if line.strip().startswith("cpu ms/cycle:")), None)
    assert line is not None, out
    figures = dict(part.rsplit(" ", 1) for part in line.removeprefix("cpu ms/cycle: ").split(";")[0].split(", "))
    assert float(figures["clients"]) > 0 and float(figures["server"]) > 0 and float(figures["all"]) > 0, out
    assert float(line.rsplit(" ", 1)[1]) > 0, out  # the cores the machine had in use


@pytest.mark.parametrize("backend", ["mariadb", "postgresql"])
def test_the_lease_index_experiment_runs(backend: str) -> None:
    """systems:PERMITS_WITHOUT_LEASE_INDEXES (docs/benchmarks.md, the non-HOT release) sets up, cycles
    and leaves no drift, on the servers whose index names it drops."""
    _cycles_without_errors("systems:PERMITS_WITHOUT_LEASE_INDEXES", backend, "1")


def test_permits_through_pgbouncer_runs() -> None:
    """systems:PERMITS_THROUGH_PGBOUNCER (docs/benchmarks.md, behind a pooler) starts its own PgBouncer in
    transaction mode, cycles through it with no errors, and leaves no drift."""
    pgbouncer_version()  # a missing pgbouncer skips here (fails in CI), as in tests/poolers
    _cycles_without_errors("systems:PERMITS_THROUGH_PGBOUNCER", "postgresql", "1,4")


def test_the_row_queue_experiment_runs() -> None:
    """row_queue:ROW_QUEUE (docs/benchmarks.md, releases on a row of their own) sets up, cycles with
    waiters queued on the row lock, and leaves no permit in use."""
    _cycles_without_errors("row_queue:ROW_QUEUE", "postgresql", "1,16")


@pytest.mark.parametrize("system", ["GET_LOCK_LINE", "GET_LOCK_LINE_FAIR", "GET_LOCK_LINE_GATED"])
def test_the_get_lock_line_experiment_runs(system: str) -> None:
    """get_lock_line (docs/benchmarks.md, a line for MariaDB's waiters) sets up, cycles with waiters queued
    in GET_LOCK, and leaves no permit in use and no drift."""
    _cycles_without_errors(f"get_lock_line:{system}", "mariadb", "1,16")


def test_the_history_floor_runs() -> None:
    """history_floor:HISTORY_FLOOR (docs/benchmarks.md, a floor that keeps the history) sets up, cycles on
    PostgreSQL with its releases kept as history, and leaves no lease held."""
    _cycles_without_errors("history_floor:HISTORY_FLOOR", "postgresql", "1,4")


def test_permits_statements_on_a_bare_driver_run() -> None:
    """bare_statements:BARE_STATEMENTS (docs/benchmarks.md, the statements without the client) captures
    permits' own grant and release, sends them on a bare driver, and leaves nothing in use; on a hot
    semaphore too, where the capture sees a refused grant before the one that took."""
    _cycles_without_errors("bare_statements:BARE_STATEMENTS", "postgresql", "1,4")


def test_the_pgbench_measurement_runs() -> None:
    """benchmarks/pgbench_statements.py (docs/benchmarks.md, the statements without the client): every
    variant's script runs under pgbench without a failed transaction, and each gets a ratio to the floor."""
    url = default_url("postgresql")
    out = _run_script("pgbench_statements.py", url, "--clients", "2", "--seconds", "1", "--rounds", "1")
    header, _rule, row = out.splitlines()
    variants = "floor | history | permits | permits-folded | folded-untokened | folded-keyed"
    assert header == f"| clients | round | {variants} |", out
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:2] == ["2", "1"] and cells[2].endswith("(1.00x)"), out
    assert all(re.fullmatch(r"[\d,]+/s [\d.]+ ms \([\d.]+x\)", cell) for cell in cells[2:]), out


def test_the_seed_in_turn_experiment_runs() -> None:
    """seed_lined:SEED_LINED (docs/benchmarks.md, the seed on SQLite served in turn) sets up, cycles with
    its writes in permits' write line, and leaves nothing acquired."""
    _cycles_without_errors("seed_lined:SEED_LINED", "sqlite", "1,4")


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_the_new_only_wait_measurement_runs(db_url: str) -> None:
    """benchmarks/new_only_wait.py, behind "A new_only waiter through the service" in docs/benchmarks.md,
    in a short run against a real service."""
    from tests._service import running

    with running(db_url) as service:
        out = _run_script(
            "new_only_wait.py", service.url, "--workers", "2", "--capacity", "1", "--seconds", "4", "--timeout", "1"
        )
    assert [line.split()[0] for line in out.splitlines()] == ["probe", "plain", "new_only"], out


def test_the_sqlite_turn_measurement_runs() -> None:
    """benchmarks/sqlite_turn.py, behind "The pool outside the write line's turn" in docs/benchmarks.md:
    each step of a SQLite write transaction is timed, in every process, at one client and at two."""
    out = _run_script("sqlite_turn.py", "--clients", "1,2", "--seconds", "0.5")
    assert [line.split()[0] for line in out.splitlines() if "clients:" in line] == ["1", "2"], out
    for step in ("turn", "transaction", "commit", "pool checkout", "BEGIN IMMEDIATE", "statement SEM_TAKE"):
        assert f"  {step} " in out, out


def test_the_driver_cost_measurement_runs() -> None:
    """benchmarks/pg_driver_cost.py, behind "Through the service at one client" in docs/benchmarks.md: one
    short round of psycopg's sync and asyncio connections."""
    out = _run_script("pg_driver_cost.py", default_url("postgresql"), "--statements", "50", "--rounds", "1")
    assert out.startswith("sync ") and " asyncio " in out, out


def test_the_sqlite_history_measurement_runs() -> None:
    """benchmarks/sqlite_history.py, behind the history bullet of docs/benchmarks.md: loop steps a cycle and
    one short round, on an empty file and on one with old rows (a few here, a million in the docs)."""
    out = _run_script("sqlite_history.py", "--rows", "2000", "--rounds", "1", "--seconds", "0.3", "--cycles", "20")
    counts = [line.split(" loop steps")[0].split(": ")[-1] for line in out.splitlines() if "loop steps" in line]
    assert len(counts) == 2 and counts[0] == counts[1], out  # the same plans whatever the history
    assert "round 1: empty " in out and "mean change" in out, out


@pytest.mark.parametrize("backend", ["mysql"], indirect=True)
def test_the_slow_hold_measurement_runs(db_url: str) -> None:
    """benchmarks/slow_hold.py, behind "A fair mutex through one slow hold" in docs/benchmarks.md, in one
    short run on MariaDB: a line of turns per second before and after the slow hold, and the summary."""
    out = _run_script("slow_hold.py", db_url, "--runs", "1", "--before", "2", "--after", "2", "--workers", "3")
    lines = out.splitlines()
    assert re.fullmatch(r"run 1: turns a second \[\d+, \d+\] \| slow hold \| \[\d+, \d+\]: .*", lines[0]), out
    assert lines[1].endswith("in the first second after the slow hold"), out
