"""The benchmark suite in quick mode, so that it cannot rot: every system runs on every backend, through
the service too, every peer runs, and permits itself reports no error and no drift (figures are not
checked here: a timed test proves nothing on a shared machine; docs/benchmarks.md has the measured ones).

A peer whose store is unreachable or whose library is missing fails the report (and so this test): in CI
that is a broken setup, not a reason to skip. Errors a peer's library raises while it runs are data about
it and do not fail the report, but at 1 and 4 clients none of them should raise any."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from peers import PEERS  # noqa: E402 - benchmarks/ is not a package

from tests.conftest import SERVER_URLS  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(900)  # the subprocess's own limit: the quick run takes 2-3 minutes, more on a busy machine
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
    for system in ("service+prelock", "service-prelock"):
        assert f"| {system} |" in done.stdout
    for peer in PEERS:
        rows = [line for line in done.stdout.splitlines() if f"| {peer} |" in line]
        assert rows, f"{peer} is missing from the report"
        for row in rows:
            errors = row.rstrip(" |").rsplit("|", 1)[1].strip()
            assert errors == "0", f"{peer} had errors: {row}"


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
