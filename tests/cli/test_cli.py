"""The `permits` command, run as a real process against every backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import permits


def _permits(db_url: str, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PERMITS_DATABASE_URL": db_url, "PERMITS_OWNER": "cli-tests"}
    done = subprocess.run(
        [sys.executable, "-m", "permits", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    if check and done.returncode != 0:
        raise AssertionError(f"permits {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done


def test_semaphore_commands(db_url: str, ns: str) -> None:
    name = f"{ns}backups"
    created = json.loads(_permits(db_url, "sem", "create", name, "--capacity", "3").stdout)
    assert created["capacity"] == 3
    changed = json.loads(_permits(db_url, "sem", "set", name, "--capacity", "5", "--reason", "more room").stdout)
    assert (changed["old_capacity"], changed["new_capacity"], changed["reason"]) == (3, 5, "more room")
    listing = _permits(db_url, "sem", "ls", "--prefix", ns).stdout
    assert name in listing and "CAPACITY" in listing
    assert [s["name"] for s in json.loads(_permits(db_url, "sem", "ls", "--prefix", ns, "--json").stdout)] == [name]
    shown = json.loads(_permits(db_url, "sem", "show", name).stdout)
    assert shown["holders"] == [] and len(shown["capacity_history"]) == 2
    assert _permits(db_url, "sem", "rm", name).stdout.startswith("deleted")
    missing = _permits(db_url, "sem", "show", name, check=False)
    assert missing.returncode == 1 and "semaphore_not_found" in missing.stderr


def test_lease_commands(db_url: str, ns: str) -> None:
    _permits(db_url, "sem", "create", f"{ns}a", "--capacity", "2")
    _permits(db_url, "sem", "create", f"{ns}b", "--capacity", "1")
    lease = json.loads(_permits(db_url, "acquire", f"{ns}a:2", f"{ns}b", "--key", f"{ns}k", "--ttl", "30").stdout)
    assert lease["counts"] == {f"{ns}a": 2, f"{ns}b": 1} and lease["owner"] == "cli-tests"
    again = json.loads(_permits(db_url, "acquire", f"{ns}a:2", f"{ns}b", "--key", f"{ns}k").stdout)
    assert again["tokens"] == lease["tokens"], "a retried acquire returns the same lease"
    refused = _permits(db_url, "acquire", f"{ns}b", "--key", f"{ns}k2", check=False)
    assert refused.returncode == 1 and "acquire_timeout" in refused.stderr
    extended = json.loads(_permits(db_url, "extend", f"{ns}k", "--ttl", "90").stdout)
    assert extended["expires_in"] > 80
    assert json.loads(_permits(db_url, "lease", f"{ns}k").stdout)["end_reason"] is None
    assert _permits(db_url, "release", f"{ns}k").stdout.strip() == "released"
    assert _permits(db_url, "release", f"{ns}k").stdout.strip() == "already_released"
    assert _permits(db_url, "release", f"{ns}nope", check=False).returncode == 1
    assert "no drift" in _permits(db_url, "reconcile").stdout
    assert "swept" in _permits(db_url, "sweep").stdout


@pytest.mark.parametrize(
    "args",
    [
        ["acquire", "x:0", "--key", "k"],
        ["acquire", "x", "--key", "k", "--ttl", "-1"],
        ["sem", "create", "", "--capacity", "1"],
        ["sem", "create", "x", "--capacity", "0"],
    ],
)
def test_bad_input_exits_2_with_a_message(db_url: str, args: list[str]) -> None:
    done = _permits(db_url, *args, check=False)
    assert done.returncode == 2 and "invalid_argument" in done.stderr and "Traceback" not in done.stderr


def test_unreachable_database_message(tmp_path: Path) -> None:
    done = _permits("postgresql://u:pw@127.0.0.1:1/x", "sem", "ls", check=False)
    assert done.returncode == 1 and "storage_unavailable" in done.stderr and "pw" not in done.stderr


def test_run_holds_the_permit_while_the_command_runs(db_url: str, ns: str, tmp_path: Path) -> None:
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    marker = tmp_path / "ran"
    code = f"import json,subprocess,sys,os; open({str(marker)!r},'w').write('x'); sys.exit(3)"
    done = _permits(db_url, "run", name, "--ttl", "5", "--", sys.executable, "-c", code, check=False)
    assert done.returncode == 3, done.stderr  # the command's own status
    assert marker.exists()
    with permits.connect(db_url) as client:
        assert client.get_semaphore(name).used == 0  # released at the end


def test_run_keeps_the_lease_alive_and_excludes_others(db_url: str, ns: str, tmp_path: Path) -> None:
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    env = {**os.environ, "PERMITS_DATABASE_URL": db_url}
    # The command runs until the test says stop, with a 1 s TTL: only the keepalive keeps the lease.
    stop = tmp_path / "stop"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "permits",
            "run",
            name,
            "--ttl",
            "1",
            "--",
            "sh",
            "-c",
            f"until [ -e {stop} ]; do sleep 0.05; done",
        ],
        env=env,
    )
    with permits.connect(db_url) as client:
        deadline = time.monotonic() + 20
        while client.get_semaphore(name).used == 0:
            assert time.monotonic() < deadline, "permits run never acquired"
            time.sleep(0.05)
        time.sleep(1.5)  # past the TTL: without renewal the lease would have expired
        assert client.try_acquire(name) is None
        busy = _permits(db_url, "run", name, "--timeout", "0", "--", "true", check=False)
        assert busy.returncode == 75
        stop.touch()
        assert holder.wait(timeout=30) == 0
        assert client.get_semaphore(name).used == 0
        assert client.reconcile() == []


def test_run_stops_the_command_when_the_lease_is_lost(db_url: str, ns: str) -> None:
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    env = {**os.environ, "PERMITS_DATABASE_URL": db_url}
    holder = subprocess.Popen(
        [sys.executable, "-m", "permits", "run", name, "--ttl", "3", "--", "sleep", "30"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    with permits.connect(db_url) as client:
        deadline = time.monotonic() + 20
        while client.get_semaphore(name).used == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.delete_semaphore(name, force=True) == 1  # an administrator revokes it
    assert holder.wait(timeout=20) == 76
    assert holder.stderr is not None and "lease lost" in holder.stderr.read()


def test_run_usage_error(db_url: str) -> None:
    done = _permits(db_url, "run", "x", check=False)
    assert done.returncode == 2 and "--" in done.stderr


def test_run_max_hold_signals_the_command_and_exits_76(db_url: str, ns: str) -> None:
    name = f"{ns}capped"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "permits",
            "run",
            name,
            "--ttl",
            "0.6",
            "--max-hold",
            "1",
            "--on-lost-signal",
            "INT",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(30)",
        ],
        env={**os.environ, "PERMITS_DATABASE_URL": db_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 76, done.stderr
    assert "lease lost while the command ran (max_hold); sending SIGINT" in done.stderr
    assert time.monotonic() - started < 15
    with permits.connect(db_url) as client:
        assert client.get_semaphore(name).used == 0
