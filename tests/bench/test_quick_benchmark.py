"""The benchmark suite in quick mode, so that it cannot rot: every system runs on every backend, through
the service too, and permits itself reports no error and no drift (figures are not checked here: a
timed test proves nothing on a shared machine; docs/benchmarks.md has the measured ones)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_benchmark_runs_every_system() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for heading in ("## sqlite", "## mariadb", "## postgresql", "## Through the service: the pre-lock"):
        assert heading in done.stdout
    for system in ("service+prelock", "service-prelock"):
        assert f"| {system} |" in done.stdout
