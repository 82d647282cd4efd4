"""The `permits` command, run as a real process against every backend."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import shlex
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import permits
import permits.cli
from permits._sync.client import Held
from tests._service import running


def _permits(db_url: str, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PERMITS_DATABASE_URL": db_url, "PERMITS_OWNER": "cli-tests"}
    done = subprocess.run(
        [sys.executable, "-m", "permits", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    if check and done.returncode != 0:
        raise AssertionError(f"permits {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done


@pytest.mark.parametrize("max_hold", ["0", "-1", "nan"])
def test_run_refuses_a_max_hold_that_is_not_positive_before_it_acquires(db_url: str, ns: str, max_hold: str) -> None:
    """A lease lost as it starts is never what was meant: a usage error (2), nothing taken, COMMAND not run."""
    name = f"{ns}capped"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    done = _permits(db_url, "run", name, "--max-hold", max_hold, "--", "touch", "/nonexistent/ran", check=False)
    assert done.returncode == 2 and ("--max-hold" in done.stderr or "max_hold" in done.stderr), done.stderr
    with permits.connect(db_url) as client:
        assert client.get_semaphore(name).used == 0 and client.holders(name) == []


def test_a_wait_that_is_not_a_number_of_seconds_is_a_usage_error_before_anything_is_asked(tmp_path: Path) -> None:
    """``-w -1`` and ``-w nan`` compared as no wait at all: COMMAND ran as with ``-n``. ``--timeout inf``
    overflowed the waits it was added to (a traceback). Now a bad wait is exit 2, with nothing taken or run,
    and ``inf`` waits with no bound. Checked before the database is reached, so SQLite stands for all."""
    db_url = f"sqlite:///{tmp_path / 'p.db'}"
    ran = tmp_path / "ran"
    _permits(db_url, "sem", "create", "m", "--capacity", "1")
    _permits(db_url, "acquire", "m", "--key", "held")
    for argv in (
        ["run", "-w", "-1", "m", "--", "touch", str(ran)],
        ["run", "--timeout", "nan", "m", "--", "touch", str(ran)],
        ["acquire", "m", "--key", "k", "--timeout", "nan"],
        ["release", "held", "--timeout", "-1"],
        ["extend", "held", "--timeout", "nan"],
        ["revoke", "held", "--reason", "r", "--timeout", "-1"],
        ["db", "ping", "--timeout", "-inf"],
    ):
        done = _permits(db_url, *argv, check=False)
        assert done.returncode == 2 and "is not a number of seconds" in done.stderr, (argv, done.stderr)
        assert "Traceback" not in done.stderr
    assert not ran.exists()
    with permits.connect(db_url) as client:
        assert [h.key for h in client.holders("m")] == ["held"]  # still held: neither released nor extended
    assert _permits(db_url, "extend", "held", "--timeout", "inf").returncode == 0
    assert _permits(db_url, "release", "held", "--timeout", "inf").stdout.strip() == "released"
    assert _permits(db_url, "run", "-w", "inf", "m", "--", "touch", str(ran)).returncode == 0 and ran.exists()


def test_run_takes_flocks_short_options(db_url: str, ns: str, tmp_path: Path) -> None:
    """-n (do not wait), -w SECONDS and -E STATUS, as flock(1) spells them, so a crontab line moves from
    flock to permits run by its lock's name alone."""
    name = f"{ns}short"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    with permits.connect(db_url) as client:
        held = client.acquire(name, timeout=5)
        started = time.monotonic()
        assert _permits(db_url, "run", "-n", name, "--", "touch", str(tmp_path / "n"), check=False).returncode == 75
        assert time.monotonic() - started < 10
        waited = _permits(db_url, "run", "-w", "0.5", "-E", "9", name, "--", "touch", str(tmp_path / "w"), check=False)
        assert waited.returncode == 9, waited.stderr
        assert not (tmp_path / "n").exists() and not (tmp_path / "w").exists()
        both = _permits(db_url, "run", "-n", "-w", "5", name, "--", "true", check=False)
        assert both.returncode == 2 and "--nonblock" in both.stderr, both.stderr
        client.release(held)
    assert _permits(db_url, "run", "-n", name, "--", "touch", str(tmp_path / "ran")).returncode == 0
    assert (tmp_path / "ran").exists()


def test_run_creates_missing_semaphores_with_create(db_url: str, ns: str, tmp_path: Path) -> None:
    """``--create N``: a cron line needs no setup step, as flock creates its lock file. A semaphore that
    exists with another capacity is an error, as with ``sem create --exist-ok``, and nothing runs; its fair
    mode does not matter."""
    names = [f"{ns}made", f"{ns}also"]
    ran = tmp_path / "ran"
    done = _permits(db_url, "run", "--create", "1", *names, "--", "touch", str(ran))
    assert done.returncode == 0 and ran.exists()
    with permits.connect(db_url) as client:
        assert [client.get_semaphore(n).capacity for n in names] == [1, 1]
        assert [client.get_semaphore(n).used for n in names] == [0, 0]
    assert _permits(db_url, "run", "--create", "1", names[0], "--", "true").returncode == 0  # exists: fine
    other = _permits(db_url, "run", "--create", "2", names[0], "--", "touch", str(tmp_path / "no"), check=False)
    assert other.returncode == 1 and "semaphore_exists" in other.stderr, other.stderr
    assert not (tmp_path / "no").exists()
    zero = _permits(db_url, "run", "--create", "0", names[0], "--", "true", check=False)
    assert zero.returncode == 2
    # One made fair at setup, or a read-write lock (fair too), is used as it is: the run does not choose the
    # mode. Another capacity is still an error.
    with permits.connect(db_url) as client:
        client.create_semaphore(f"{ns}fair", 3, fair=True)
        readers = client.create_rwlock(f"{ns}rw").capacity
    assert _permits(db_url, "run", "--create", "3", f"{ns}fair", "--", "true").returncode == 0
    assert _permits(db_url, "run", "--create", str(readers), f"{ns}rw:1", "--", "true").returncode == 0
    other = _permits(db_url, "run", "--create", "2", f"{ns}fair", "--", "true", check=False)
    assert other.returncode == 1 and "semaphore_exists" in other.stderr, other.stderr


def test_db_may_come_before_the_command_and_the_commands_own_wins(tmp_path: Path) -> None:
    """``permits --db URL COMMAND``, as kubectl takes --context: it beats $PERMITS_DATABASE_URL, and the
    command's own --db beats it."""
    first, env, own = (f"sqlite:///{tmp_path / n}.db" for n in ("first", "env", "own"))
    for url in (first, env, own):
        with permits.connect(url) as client:
            client.create_semaphore(url.rsplit("/", 1)[1].removesuffix(".db"), 1)

    def names(*args: str) -> list[str]:
        done = _permits(env, *args)
        return [line.split()[0] for line in done.stdout.splitlines()[1:]]

    assert names("--db", first, "sem", "ls") == ["first"]
    assert names("sem", "ls") == ["env"]
    assert names("--db", first, "sem", "ls", "--db", own) == ["own"]
    ran = _permits(env, "--db", first, "run", "first", "--", sys.executable, "-c", "print('inside')")
    assert ran.stdout.strip() == "inside"
    with permits.connect(first) as client:
        assert client.get_semaphore("first").last_token == 1  # the lease was taken there, not in env's


def test_run_starts_commands_as_a_shell_would(tmp_path: Path, ns: str) -> None:
    """A script without ``#!`` runs with /bin/sh (as execvp does, so flock and env); a command that is not
    there exits 127 and one that may not be run 126, the shell's codes; the lease is released each time."""
    url = f"sqlite:///{tmp_path / 'p.db'}"
    name = f"{ns}job"
    _permits(url, "sem", "create", name, "--capacity", "1")
    script = tmp_path / "no-shebang"
    script.write_text('echo "$1 ran under sh"\n')
    script.chmod(0o755)
    plain = tmp_path / "not-executable"
    plain.write_text("echo never\n")
    ran = _permits(url, "run", name, "--", str(script), "it", check=False)
    assert (ran.returncode, ran.stdout.strip()) == (0, "it ran under sh"), ran.stderr
    missing = _permits(url, "run", name, "--", str(tmp_path / "nothing-here"), check=False)
    assert missing.returncode == 127 and "cannot run" in missing.stderr
    refused = _permits(url, "run", name, "--", str(plain), check=False)
    assert refused.returncode == 126 and "cannot run" in refused.stderr
    with permits.connect(url) as client:
        assert client.get_semaphore(name).used == 0 and client.get_semaphore(name).last_token == 3


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
    claimed = _permits(db_url, "acquire", f"{ns}a:2", f"{ns}b", "--key", f"{ns}k", "--new-only", check=False)
    assert claimed.returncode == 1 and "key_in_use" in claimed.stderr and not claimed.stdout
    extended = json.loads(_permits(db_url, "extend", f"{ns}k", "--ttl", "90").stdout)
    assert extended["expires_in"] > 80
    assert 28 < json.loads(_permits(db_url, "extend", f"{ns}k").stdout)["expires_in"] <= 30  # its own TTL, 30 s
    assert json.loads(_permits(db_url, "lease", f"{ns}k").stdout)["end_reason"] is None
    assert _permits(db_url, "release", f"{ns}k").stdout.strip() == "released"
    assert _permits(db_url, "release", f"{ns}k").stdout.strip() == "already_released"
    assert _permits(db_url, "release", f"{ns}nope", check=False).returncode == 1
    assert "no drift" in _permits(db_url, "reconcile").stdout
    assert "swept" in _permits(db_url, "sweep").stdout


def test_sweep_and_reconcile_with_a_timeout_say_what_they_left_as_json_too(db_url: str, ns: str) -> None:
    """``permits sweep --timeout`` starts no batch after it and says the sweep was incomplete (a note on
    stderr; ``complete`` in the JSON); ``permits reconcile --repair --timeout`` starts no repair after it,
    shows the drift left unrepaired and exits 1; with time enough both finish, and exit 0."""
    from sqlalchemy import create_engine, text

    from tests.conftest import sqlalchemy_url

    name = f"{ns}swept"
    _permits(db_url, "sem", "create", name, "--capacity", "5")
    for i in range(3):
        _permits(db_url, "acquire", name, "--key", f"{ns}k{i}", "--ttl", "0.2")
    time.sleep(0.4)
    first = json.loads(_permits(db_url, "sweep", "--batch-size", "1", "--timeout", "0", "--json").stdout)
    assert (first["leases"], first["batches"], first["complete"]) == (1, 1, False), first
    noted = _permits(db_url, "sweep", "--batch-size", "1", "--timeout", "0")
    assert noted.stdout.startswith("swept 1 lease(s) in 1 batch(es)") and "stopped at --timeout" in noted.stderr
    rest = json.loads(_permits(db_url, "sweep", "--timeout", "30", "--json").stdout)
    assert rest["complete"] is True, rest
    with permits.connect(db_url, owner="cli-tests") as client:
        assert {client.get_lease(f"{ns}k{i}").end_reason for i in range(3)} == {permits.EndReason.SWEPT}

    _permits(db_url, "acquire", f"{name}:2", "--key", f"{ns}held", "--ttl", "60")
    engine = create_engine(sqlalchemy_url(db_url))
    with engine.begin() as conn:  # damage the count behind permits' back
        conn.execute(text("UPDATE permits_semaphore SET used = 4 WHERE name = :n"), {"n": name})
    engine.dispose()
    shown = _permits(db_url, "reconcile", check=False)
    assert f"DRIFT: {name}: permits in use recorded 4, actual 2" in shown.stdout.splitlines(), shown.stdout
    left = _permits(db_url, "reconcile", "--repair", "--timeout", "0", "--json", check=False)
    assert left.returncode == 1, left.stderr
    mine = [d for d in json.loads(left.stdout) if d["name"] == name]
    assert mine == [{"name": name, "field": "used", "recorded": 4, "actual": 2, "repaired": False}], mine
    repaired = json.loads(_permits(db_url, "reconcile", "--repair", "--timeout", "30", "--json").stdout)
    assert [d["repaired"] for d in repaired if d["name"] == name] == [True]
    checked = _permits(db_url, "reconcile", "--json", check=False)  # other tests' drift is theirs
    assert all(d["name"] != name for d in json.loads(checked.stdout)), checked.stdout


def test_reconcile_names_every_kind_of_drift_the_service_can_report() -> None:
    """Each ``Drift.field`` the service's schema allows has words of its own in ``permits reconcile``."""
    from typing import get_args

    from permits.cli import _DRIFT_FIELDS
    from permits.server.schemas import DriftOut

    assert set(_DRIFT_FIELDS) == set(get_args(DriftOut.model_fields["field"].annotation))


def test_revoke_ends_anyones_lease_by_owner_and_key(db_url: str, ns: str) -> None:
    """An operator's end of a stuck holder's lease: ``permits sem show`` lists the owner and key, ``permits
    revoke`` ends it with a reason, and its permits are free at once; the holder's next extend is refused."""
    name = f"{ns}r"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    with permits.connect(db_url, owner=f"{ns}host-3") as holder:
        lease = holder.acquire(name, key="nightly", ttl=300)
        shown = json.loads(_permits(db_url, "sem", "show", name).stdout)["holders"]
        assert [(h["owner"], h["key"]) for h in shown] == [(f"{ns}host-3", "nightly")]
        mine = _permits(db_url, "revoke", "nightly", "--reason", "host-3 lost its disk", check=False)
        assert mine.returncode == 1 and "lease_not_found" in mine.stderr  # --owner defaults to the caller's own
        ended = json.loads(
            _permits(db_url, "revoke", "nightly", "--owner", f"{ns}host-3", "--reason", "host-3 lost its disk").stdout
        )
        assert ended["end_reason"] == "revoked" and ended["end_note"] == "host-3 lost its disk", ended
        assert holder.get_semaphore(name).used == 0
        with pytest.raises(permits.LeaseLost):
            holder.extend(lease)
    again = _permits(db_url, "revoke", "nightly", "--owner", f"{ns}host-3", "--reason", "again")
    unchanged = ("end_reason", "end_note", "ended_at")
    assert [json.loads(again.stdout)[f] for f in unchanged] == [ended[f] for f in unchanged], "answered as it is"
    no_reason = _permits(db_url, "revoke", "nightly", "--owner", f"{ns}host-3", check=False)
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr


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


def test_run_does_not_wait_for_a_sqlite_file_that_cannot_be_opened(tmp_path: Path) -> None:
    """``permits run`` waits through a server's outage at its start, within --timeout; an embedded database
    has none to wait for: a file that cannot be opened is a wrong path, said at once."""
    started = time.monotonic()
    url = f"sqlite:///{tmp_path}/no/such/dir/p.db"
    done = _permits(url, "run", "--timeout", "60", "x", "--", "true", check=False)
    assert done.returncode == 1 and "through an outage" not in done.stderr, done.stderr
    assert time.monotonic() - started < 30


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
    assert holder.stderr is not None
    told = holder.stderr.read()
    assert "lease lost" in told
    # The library's own warning too, as the CLI writes its lines (it was printed bare before).
    assert all(line.startswith("permits: ") for line in told.splitlines()), told


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


def _wait_until_held(db_url: str, name: str, used: int = 1) -> None:
    with permits.connect(db_url) as client:
        deadline = time.monotonic() + 20
        while client.get_semaphore(name).used < used:
            assert time.monotonic() < deadline, "permits run never acquired"
            time.sleep(0.05)


def test_run_tells_the_command_its_lease_key_and_fencing_token(db_url: str, ns: str, tmp_path: Path) -> None:
    name, seen = f"{ns}cron", tmp_path / "env.json"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    code = (
        "import json, os; names = ('PERMITS_LEASE_KEY', 'PERMITS_FENCING_TOKEN', 'PERMITS_FENCING_TOKENS');"
        f" open({str(seen)!r}, 'w').write(json.dumps({{n: os.environ.get(n) for n in names}}))"
    )
    _permits(db_url, "run", name, "--key", f"{ns}job", "--", sys.executable, "-c", code)
    env = json.loads(seen.read_text())
    with permits.connect(db_url, owner="cli-tests") as client:
        token = client.get_lease(f"{ns}job").tokens[name]
    assert env["PERMITS_LEASE_KEY"] == f"{ns}job"
    assert env["PERMITS_FENCING_TOKEN"] == str(token)
    assert json.loads(env["PERMITS_FENCING_TOKENS"]) == {name: str(token)}


def _in_background(db_url: str, *args: str) -> subprocess.Popen[str]:
    """``permits ARGS`` started, not waited for; its stderr kept to read."""
    env = {**os.environ, "PERMITS_DATABASE_URL": db_url}
    return subprocess.Popen([sys.executable, "-m", "permits", *args], env=env, stderr=subprocess.PIPE, text=True)


def test_run_kills_a_command_that_ignores_its_signal_for_a_lost_lease(db_url: str, ns: str) -> None:
    """The command must not work on unprotected: one that ignores SIGTERM is killed --kill-after later."""
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    run = ["run", name, "--ttl", "3", "--kill-after", "1", "--", sys.executable, "-c", stubborn]
    holder = _in_background(db_url, *run)
    _wait_until_held(db_url, name)
    with permits.connect(db_url) as client:
        assert client.delete_semaphore(name, force=True) == 1  # an administrator revokes it
    revoked = time.monotonic()
    assert holder.wait(timeout=30) == 76
    assert time.monotonic() - revoked < 15
    assert holder.stderr is not None and "SIGKILL" in holder.stderr.read()


@pytest.mark.parametrize("job", ["ends", "ignores"])
def test_a_lost_lease_signals_every_process_of_the_command(db_url: str, ns: str, tmp_path: Path, job: str) -> None:
    """A shell that started a job: on a lost lease the job gets the signal too. Sent to the shell alone (as
    before), the SIGTERM ended the shell and left the job running, unprotected, with a second holder let in.
    A job that ignores the signal outlives the shell, which dies of it: it gets SIGKILL --kill-after later
    all the same, once the shell has ended."""
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    job_pid = tmp_path / "job.pid"
    started = "sleep 60 &" if job == "ends" else "(trap '' TERM; sleep 60) &"  # an ignored signal stays so in exec
    script = f"{started} echo $! > {job_pid}; wait"
    run = ["run", name, "--ttl", "3", "--kill-after", "1", "--", "sh", "-c", script]
    holder = _in_background(db_url, *run)
    _wait_until_held(db_url, name)
    job_process = _started_job(job_pid, 10)
    assert _running(job_process)
    with permits.connect(db_url) as client:
        assert client.delete_semaphore(name, force=True) == 1  # an administrator revokes it
    assert holder.wait(timeout=30) == 76
    _assert_ends_soon(job_process)  # (stderr is read after: the job holds the pipe open while it lives)
    assert holder.stderr is not None
    told = holder.stderr.read()
    if job == "ignores":
        assert "processes the command started still ran 1 s after its signal: SIGKILL" in told, told


def test_a_job_signalled_for_a_lost_lease_is_killed_however_the_threads_interleave(
    db_url: str, ns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lost lease's signal goes out on the watchdog's thread while the main one waits for COMMAND. A
    shell that dies of it at once returns that wait, and the run used to decide whether anything was left
    to kill before the watchdog had written down the job below the shell: it exited 76 with the job,
    which ignores SIGTERM, still running unprotected (CI caught this twice under load). Here the signal
    to each process below COMMAND is made slow, so that order happens every time. In process, so that
    it can be."""
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    job_pid = tmp_path / "job.pid"
    script = f"(trap '' TERM; sleep 60) & echo $! > {job_pid}; wait"
    real_signal = permits.cli._Process.signal

    def slow_signal(self: Any, signum: int) -> None:
        if signum != signal.SIGKILL:
            time.sleep(1)  # the shell has died of its signal by now, and the main thread has seen it
        real_signal(self, signum)

    monkeypatch.setattr(permits.cli._Process, "signal", slow_signal)

    def revoke_once_the_job_runs() -> None:
        _started_job(job_pid)
        with permits.connect(db_url) as client:
            assert client.delete_semaphore(name, force=True) == 1  # an administrator revokes it

    revoker = threading.Thread(target=revoke_once_the_job_runs)
    revoker.start()
    try:
        _run_in_process_until_the_job_is_killed(db_url, name, script, job_pid)
    finally:
        revoker.join()


def test_a_lease_lost_as_the_command_starts_still_gets_the_job_killed(
    db_url: str, ns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease is lost while COMMAND's process is being made, and the watchdog's thread, which learnt it
    first, is held up before its signal: the main thread sends the signal as COMMAND starts. It used to send
    it without starting the --kill-after clock, so the run ended as soon as the shell died of it, and the
    job below the shell, which ignores SIGTERM, ran on unprotected. In process, so that the order can be
    made every time."""
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    job_pid = tmp_path / "job.pid"
    script = f"(trap '' TERM; sleep 60) & echo $! > {job_pid}; wait"
    watchdog_told = threading.Event()
    real_echo, real_start = permits.cli.click.echo, permits.cli._start

    def held_up_echo(message: Any = None, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread() and "lease lost" in str(message):
            watchdog_told.set()
            time.sleep(2)  # the watchdog's thread, the loss set, before its signal
        real_echo(message, *args, **kwargs)

    def start_then_lose(*args: Any) -> subprocess.Popen[bytes]:
        made = real_start(*args)
        _started_job(job_pid)
        with permits.connect(db_url) as client:
            assert client.delete_semaphore(name, force=True) == 1  # an administrator revokes it
        assert watchdog_told.wait(20), "the watchdog never found the lease lost"
        return made

    monkeypatch.setattr(permits.cli.click, "echo", held_up_echo)
    monkeypatch.setattr(permits.cli, "_start", start_then_lose)
    _run_in_process_until_the_job_is_killed(db_url, name, script, job_pid)


def test_a_supervisors_sigterm_reaches_every_process_of_the_command_and_the_permits_wait_for_them(
    db_url: str, ns: str, tmp_path: Path
) -> None:
    """``sh -c 'job; next'`` stopped by a supervisor's SIGTERM: sent to the shell alone, it ended the shell
    at once and the run released the permits while ``job`` still worked (a second run got in beside it).
    The signal goes to every process of the command, and the permits stay held until the last has ended:
    here a job that finishes its work, once told to stop, only when the test lets it (a fixed 2 s was once
    spent on the second run's start on a loaded machine, which then found the permits free)."""
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    done, finish = tmp_path / "done", tmp_path / "finish"
    job = (
        "import os, signal, sys, time\n"
        "def stop(*_):\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    open(sys.argv[1], 'w').close()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('working', flush=True)\n"
        "time.sleep(60)\n"
    )
    script = f"{sys.executable} -c {shlex.quote(job)} {done} {finish}; echo next"
    env = {**os.environ, "PERMITS_DATABASE_URL": db_url}
    holder = subprocess.Popen(
        [sys.executable, "-m", "permits", "run", name, "--ttl", "30", "--", "sh", "-c", script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "working\n"
    holder.send_signal(signal.SIGTERM)
    # While the job finishes, the permits are held: another run is refused.
    time.sleep(0.5)
    other = _permits(db_url, "run", name, "--timeout", "0", "--", "true", check=False)
    assert other.returncode == 75, other.stderr
    assert not done.exists()
    finish.touch()
    assert holder.wait(timeout=30) == 128 + signal.SIGTERM  # the shell's own status: it died of the signal
    assert done.exists()  # the run ended only once the job had
    assert holder.stderr is not None and "still run: the permits stay held until they end" in holder.stderr.read()
    with permits.connect(db_url) as client:
        assert client.get_semaphore(name).used == 0


def _run_in_process_until_the_job_is_killed(db_url: str, name: str, script: str, job_pid: Path) -> None:
    """``permits run NAME -- sh -c SCRIPT`` in this process, whose lease the test has lost: it exits 76, and
    the job the script started (its pid in ``job_pid``) ends soon after; killed here whatever happens."""
    done = CliRunner().invoke(
        permits.cli.main, ["run", name, "--db", db_url, "--ttl", "3", "--kill-after", "1", "--", "sh", "-c", script]
    )
    job_process = int(job_pid.read_text())
    try:
        assert done.exit_code == 76, done.output
        _assert_ends_soon(job_process)
    finally:
        with suppress(ProcessLookupError):
            os.kill(job_process, signal.SIGKILL)


def _started_job(job_pid: Path, seconds: float = 20) -> int:
    """The pid a command's shell wrote to ``job_pid`` once it started its job."""
    deadline = time.monotonic() + seconds
    while not job_pid.exists() or not job_pid.read_text().strip():
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)
    return int(job_pid.read_text())


def _assert_ends_soon(job_process: int) -> None:
    """The job ends within 5 s: a SIGKILL sent as permits run ends takes effect a moment later."""
    deadline = time.monotonic() + 5
    while _running(job_process):
        assert time.monotonic() < deadline, f"the job went on after the lease was lost: {_family(job_process)}"
        time.sleep(0.05)


def _family(pid: int) -> str:
    """``pid``'s /proc/PID/stat and its children's, for a failure's message."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().split(" ")[:5]
        children = [Path(f"/proc/{pid}/task/{t}/children").read_text() for t in os.listdir(f"/proc/{pid}/task")]
    except OSError as exc:
        return f"pid {pid}: {exc}"
    return f"pid {pid}: stat {' '.join(stat)}; children {children}"


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by whoever inherited it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def test_run_keeps_the_commands_status_when_the_release_fails(db_url: str, backend: str, ns: str) -> None:
    """The command ran and exited 3; then the database could not be reached to release. Its status is
    still the outcome (a retrying scheduler must not run a finished job again), with a warning; the lease
    runs out at its TTL."""
    if backend == "sqlite":
        pytest.skip("the database is cut through a TCP proxy")
    from tests._proxy import CuttingProxy

    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    with CuttingProxy.before(db_url) as proxy:
        holder = subprocess.Popen(
            [sys.executable, "-m", "permits", "run", name, "--ttl", "30", "--", "sh", "-c", "sleep 2; exit 3"],
            env={**os.environ, "PERMITS_DATABASE_URL": proxy.url_for(db_url)},
            stderr=subprocess.PIPE,
            text=True,
        )
        _wait_until_held(db_url, name)
        proxy.close()  # refuses new connections and cuts the open ones
        assert holder.wait(timeout=60) == 3
    assert holder.stderr is not None and "could not release the lease" in holder.stderr.read()
    with permits.connect(db_url) as client:
        assert client.get_semaphore(name).used == 1  # held until its TTL


@pytest.mark.slow
def test_run_does_not_outlive_its_command_by_more_than_the_release_patience_when_the_database_hangs(
    db_url: str, backend: str, ns: str, tmp_path: Path
) -> None:
    """The database stops answering (a hung server, a stalled link) while the command runs, and the command
    ends: the release is tried for RELEASE_PATIENCE seconds, not for minutes of retries each waiting for its
    reply, and the run exits with the command's status; the lease runs out at its TTL."""
    if backend == "sqlite":
        pytest.skip("the database is stalled through a TCP proxy")
    from tests._proxy import CuttingProxy

    name, started, go = f"{ns}cron", tmp_path / "started", tmp_path / "go"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    # The command says when it runs and ends when told, so that the stall comes while it runs however slow
    # a loaded machine is (a fixed sleep and a fixed wait for the lease both failed under four CI workers).
    command = f"touch {shlex.quote(str(started))}; while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.05; done; exit 3"
    with CuttingProxy.before(db_url) as proxy:
        holder = subprocess.Popen(
            [sys.executable, "-m", "permits", "run", name, "--ttl", "60", "--", "sh", "-c", command],
            env={**os.environ, "PERMITS_DATABASE_URL": proxy.url_for(db_url)},
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while not started.exists():
                assert holder.poll() is None, holder.communicate()[1]
                assert time.monotonic() < deadline, "permits run never started its command"
                time.sleep(0.05)
            proxy.stall()  # nothing passes either way, and nothing is cut
            stalled = time.monotonic()
            go.touch()
            assert holder.wait(timeout=120) == 3
            took = time.monotonic() - stalled
        finally:
            if holder.poll() is None:  # a failed assertion leaves no run behind, riding out the closed proxy
                holder.kill()
                holder.wait()
    assert took < permits.cli.RELEASE_PATIENCE + 5, took
    assert holder.stderr is not None
    told = holder.stderr.read()
    assert f"could not release the lease within {permits.cli.RELEASE_PATIENCE:g} s" in told, told


@pytest.mark.parametrize(
    ("stop", "said"),
    [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "stopped by SIGTERM"), (signal.SIGHUP, "stopped by SIGHUP")],
)
def test_run_stopped_while_waiting_says_so_and_holds_nothing(
    db_url: str, ns: str, stop: signal.Signals, said: str
) -> None:
    """Ctrl-C, or a supervisor's SIGTERM, while `permits run` waits: a message, 128 + the signal, nothing
    held (a grant that came as it was stopped is released by key), not a silent death."""
    name = f"{ns}cron"
    # Fair, so that the run's wait shows, as its place in the queue: a fixed 2 s was sometimes spent on
    # Python's start-up on a busy machine (CI, four workers), and the signal then found no handler yet.
    _permits(db_url, "sem", "create", name, "--capacity", "1", "--fair")
    with permits.connect(db_url, owner="other") as client:
        held = client.acquire(name, ttl=60)
        waiting = subprocess.Popen(
            [sys.executable, "-m", "permits", "run", name, "--key", f"{ns}job", "--", "true"],
            env={**os.environ, "PERMITS_DATABASE_URL": db_url, "PERMITS_OWNER": "cli-tests"},
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while f"{ns}job" not in [w.key for w in client.waiters(name)]:  # waiting for room by now
            assert waiting.poll() is None and time.monotonic() < deadline, "permits run never waited"
            time.sleep(0.05)
        waiting.send_signal(stop)
        assert waiting.wait(timeout=30) == 128 + stop
        assert waiting.stderr is not None and said in waiting.stderr.read()
        client.release(held)
        with pytest.raises(permits.LeaseNotFound):
            client.get_lease(f"{ns}job", owner="cli-tests")
        assert client.get_semaphore(name).used == 0


def test_a_second_run_under_a_held_key_is_refused(db_url: str, ns: str, tmp_path: Path) -> None:
    """The same key is the same request: a second `permits run --key K` would get the first one's lease
    back and run beside it. It is refused with the conflict status instead."""
    name = f"{ns}job"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    stop = tmp_path / "stop"
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "permits",
            "run",
            name,
            "--key",
            "J",
            "--",
            "sh",
            "-c",
            f"until [ -e {stop} ]; do sleep 0.05; done",
        ],
        env={**os.environ, "PERMITS_DATABASE_URL": db_url, "PERMITS_OWNER": "cli-tests"},
    )
    try:
        _wait_until_held(db_url, name)
        second = _permits(db_url, "run", name, "--key", "J", "--timeout", "0", "--", "true", check=False)
        assert second.returncode == 75 and "held already" in second.stderr, second.stderr
    finally:
        stop.touch()
        assert first.wait(timeout=30) == 0


@pytest.mark.slow
def test_runs_under_one_key_that_get_room_at_once_run_one_command(db_url: str, ns: str, tmp_path: Path) -> None:
    """Four `permits run --key J` wait on a semaphore with room for all four, which comes at once. Each
    looked for a lease under J before it waited, and found none; the first grant makes one, and every other
    run's grant then finds it. Answered as a retry, they would all run beside it; asking for a new lease
    only, they are refused by the database as it grants, and exactly one command runs."""
    name, runs = f"{ns}fleet", 4
    _permits(db_url, "sem", "create", name, "--capacity", str(runs))
    ran = tmp_path / "ran"
    env = {**os.environ, "PERMITS_DATABASE_URL": db_url, "PERMITS_OWNER": "cli-tests"}
    command = f"echo $PERMITS_FENCING_TOKEN >> {ran}; sleep 5"
    run = [sys.executable, "-m", "permits", "run", name, "--key", f"{ns}J", "--timeout", "60", "--"]
    with permits.connect(db_url, owner="blocker") as client:
        blocker = client.acquire({name: runs}, ttl=60)
        waiting = [
            subprocess.Popen(
                [*run, "sh", "-c", command],
                env=env,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(runs)
        ]
        time.sleep(3)  # every run has started and waits for room (one that comes later races all the same)
        client.release(blocker)
        statuses = [run.wait(timeout=60) for run in waiting]
        said = [run.stderr.read() if run.stderr is not None else "" for run in waiting]
    assert sorted(statuses) == [0] + [75] * (runs - 1), said
    assert len(ran.read_text().split()) == 1
    assert sum("held already" in text or "used already" in text for text in said) == runs - 1, said


@pytest.mark.parametrize(
    "args",
    [
        ["run", "x", "--conflict-exit-code", "300", "--", "true"],
        ["run", "x", "--conflict-exit-code", "-1", "--", "true"],
        ["demo", "--hold", "-1"],
        ["demo", "--hold", "nan"],
        ["demo", "--workers", "0"],
    ],
)
def test_cli_numbers_out_of_range_are_usage_errors(db_url: str, args: list[str]) -> None:
    done = _permits(db_url, *args, check=False)
    assert done.returncode == 2 and "Invalid value" in done.stderr and "Traceback" not in done.stderr


def test_a_count_in_other_digits_is_not_read_as_a_count(db_url: str, ns: str) -> None:
    """int() reads "٣" as 3 and fails on "²": only ASCII digits make a count; the rest is part of a name."""
    _permits(db_url, "sem", "create", f"{ns}c", "--capacity", "5")
    for spec in (f"{ns}c:²", f"{ns}c:٣"):
        done = _permits(db_url, "acquire", spec, "--key", "k", check=False)
        assert done.returncode == 1 and "semaphore_not_found" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_an_inner_run_over_several_semaphores_drops_the_outer_fencing_token(db_url: str, ns: str) -> None:
    for name in ("outer", "d", "e"):
        _permits(db_url, "sem", "create", f"{ns}{name}", "--capacity", "1")
    inner = [
        sys.executable,
        "-m",
        "permits",
        "run",
        f"{ns}d",
        f"{ns}e",
        "--",
        "sh",
        "-c",
        "echo ${PERMITS_FENCING_TOKEN-none}",
    ]
    done = _permits(db_url, "run", f"{ns}outer", "--", *inner)
    assert done.stdout.strip() == "none"


def test_run_a_mistyped_option_is_a_usage_error_not_a_semaphore(db_url: str) -> None:
    done = _permits(db_url, "run", "x", "--tll", "5", "--", "true", check=False)
    assert done.returncode == 2 and "no such option" in done.stderr.lower() and "--tll" in done.stderr


@pytest.mark.parametrize("value", ["nan", "-2", "inf", "soon"])
def test_run_kill_after_must_be_seconds_or_minus_one(db_url: str, ns: str, value: str) -> None:
    """A NaN never compares as due: the command would keep running on a lost lease."""
    done = _permits(db_url, "run", f"{ns}x", "--kill-after", value, "--", "true", check=False)
    assert done.returncode == 2 and "--kill-after" in done.stderr and "Traceback" not in done.stderr
    with permits.connect(db_url) as client:
        assert client.list_semaphores(prefix=ns) == []  # nothing was created or held


def test_run_from_python_splits_at_its_own_arguments(db_url: str, ns: str, tmp_path: Path) -> None:
    """``main([...])`` from a Python program: the ``--`` is looked for in the arguments given, not in
    the Python program's own command line."""
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    marker = tmp_path / "ran"
    code = f"import sys; open({str(marker)!r}, 'w').write(sys.argv[1]); sys.exit(4)"
    done = CliRunner().invoke(
        permits.cli.main, ["run", name, "--db", db_url, "--", sys.executable, "-c", code, "--verbose"]
    )
    assert done.exit_code == 4, done.output
    assert marker.read_text() == "--verbose"  # COMMAND's own options stay COMMAND's
    with permits.connect(db_url) as client:
        assert client.get_semaphore(name).used == 0


def test_a_signal_while_the_command_starts_reaches_the_command(
    db_url: str, ns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor's SIGTERM that comes as COMMAND's process is being made, after its exec and before
    ``permits run`` knows its pid, is passed on to COMMAND once it knows it. It used to stop the run as
    if COMMAND had not started, and the command, running already, died by SIGKILL with the run (likely
    what failed the Ctrl-C test above once, under load). In process, so that the signal can be sent at
    that very point."""
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    started = tmp_path / "started"
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n"
        f"open({str(started)!r}, 'w').close()\n"
        "time.sleep(30)\n"
        "sys.exit(0)\n"
    )
    real_popen = subprocess.Popen

    def popen_then_signal(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        made = real_popen(*args, **kwargs)
        try:
            deadline = time.monotonic() + 30
            while not started.exists():  # COMMAND runs, and has its handler
                assert time.monotonic() < deadline, "the command never started"
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)  # before Popen has returned to the run
            time.sleep(0.1)  # the handler runs here, in the main thread
        except BaseException:  # the run stopped here (as it did before): COMMAND must not outlive the test
            made.kill()
            made.wait()
            raise
        return made

    monkeypatch.setattr(permits.cli.subprocess, "Popen", popen_then_signal)
    began = time.monotonic()
    done = CliRunner().invoke(permits.cli.main, ["run", name, "--db", db_url, "--", sys.executable, "-c", code])
    assert done.exit_code == 3, done.output  # COMMAND's own status: it got the SIGTERM and ended on it
    assert time.monotonic() - began < 20
    with permits.connect(db_url) as client:
        assert client.get_semaphore(name).used == 0


def test_a_signal_just_as_the_grant_comes_back_releases_it(
    db_url: str, ns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM that comes after the lease's grant has come back, before the run is inside the block that
    gives it back, stops the run and releases the lease (it used to leave it held until its TTL)."""
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    marker = tmp_path / "ran"
    real_enter = Held.__enter__

    def enter_then_signal(self: Held) -> permits.Lease:
        lease = real_enter(self)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs here, in the main thread
        return lease

    monkeypatch.setattr(Held, "__enter__", enter_then_signal)
    done = CliRunner().invoke(
        permits.cli.main,
        ["run", name, "--db", db_url, "--ttl", "300", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
    )
    assert done.exit_code == 128 + signal.SIGTERM, done.output
    assert not marker.exists()  # COMMAND never ran
    with permits.connect(db_url) as client:
        assert client.get_semaphore(name).used == 0  # released now, not at the TTL


def test_a_killed_permits_run_takes_its_command_with_it(db_url: str, ns: str, tmp_path: Path) -> None:
    """SIGKILL (or the OOM killer) leaves no one to keep the lease alive or stop the command: the kernel's
    parent-death signal ends the command, so it cannot go on working once the lease expires."""
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    holder = subprocess.Popen(
        [sys.executable, "-m", "permits", "run", name, "--ttl", "30", "--", sys.executable, "-c", code],
        env={**os.environ, "PERMITS_DATABASE_URL": db_url},
    )
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    command = int(pid_file.read_text())
    holder.kill()
    holder.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _is_running(command):
        assert time.monotonic() < deadline, "the command outlived a killed permits run"
        time.sleep(0.05)


def _is_running(pid: int) -> bool:
    """Whether ``pid`` still runs: gone, or a zombie waiting for whoever adopted it to reap it, is not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_ctrl_c_at_the_terminal_reaches_the_command_once(db_url: str, ns: str) -> None:
    """The terminal sends Ctrl-C's SIGINT to its whole foreground process group, the command included:
    `permits run` must not send it again, or the command takes it for a second Ctrl-C (terraform, docker
    compose and many services then skip their clean shutdown)."""
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    counter = (
        "import signal, sys, time\n"
        "heard = []\n"
        "signal.signal(signal.SIGINT, lambda *a: heard.append(1))\n"
        "print('ready', flush=True)\n"
        "while not heard: time.sleep(0.01)\n"
        "time.sleep(1.0)\n"
        "print('heard', len(heard), flush=True)\n"
    )
    env = {**os.environ, "PERMITS_DATABASE_URL": db_url}
    pid, terminal = pty.fork()
    if pid == 0:  # the child: a session of its own, with the pty as its controlling terminal
        command = [sys.executable, "-m", "permits", "run", name, "--", sys.executable, "-c", counter]
        os.execve(sys.executable, command, env)
    output = b""
    deadline = time.monotonic() + 30
    while b"ready" not in output:
        assert time.monotonic() < deadline, output
        output += os.read(terminal, 1024)
    os.write(terminal, b"\x03")  # Ctrl-C
    while True:
        try:
            chunk = os.read(terminal, 1024)
        except OSError:  # EIO: the session has ended
            break
        if not chunk:
            break
        output += chunk
    _, status = os.waitpid(pid, 0)
    assert b"heard 1" in output, output
    assert os.waitstatus_to_exitcode(status) == 0, output


def test_a_command_that_makes_the_default_database_says_so(tmp_path: Path) -> None:
    """With no --db and no PERMITS_DATABASE_URL, the default is a file in the working directory: shared by
    nothing else. Made silently, a cron line that lacks the variable would hold its lock alone."""
    env = {k: v for k, v in os.environ.items() if k != "PERMITS_DATABASE_URL"}
    first = subprocess.run(
        [sys.executable, "-m", "permits", "sem", "ls"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr
    assert f"making permits.db in {tmp_path}" in first.stderr and (tmp_path / "permits.db").exists()
    again = subprocess.run(
        [sys.executable, "-m", "permits", "sem", "ls"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert again.returncode == 0 and again.stderr == ""  # the file is there: nothing to say


def test_ctrl_c_while_acquire_waits_says_so_exits_130_and_holds_nothing(db_url: str, ns: str) -> None:
    name = f"{ns}full"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    # Ctrl-C reaches a foreground process; one started in the background by a shell without job control
    # inherits SIGINT ignored, so the child takes Python's own handler back first.
    code = (
        "import signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from permits.cli import main\n"
        "main(sys.argv[1:], prog_name='permits')\n"
    )
    with permits.connect(db_url, owner=f"{ns}h") as client:
        held = client.acquire(name, ttl=60)
        waiting = subprocess.Popen(
            [sys.executable, "-c", code, "acquire", name, "--key", f"{ns}k", "--timeout", "30", "--db", db_url],
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(2)  # waiting for room
        waiting.send_signal(signal.SIGINT)
        assert waiting.wait(timeout=30) == 130
        assert waiting.stderr is not None
        told = waiting.stderr.read()
        assert "permits: interrupted" in told and "Aborted" not in told, told
        assert [h.key for h in client.holders(name)] == [held.key]
        client.release(held)


def test_db_ping_says_whether_the_database_answers_with_the_schema(db_url: str, tmp_path: Path) -> None:
    """``permits db ping``, for scripts and exec probes: exit 0 when the database answers with the schema
    this version needs; 1 with the error when it cannot be reached, or has no tables (it makes none); 2
    for a bad timeout."""
    with permits.connect(db_url) as client:
        client.ping()  # the tables, on SQLite
        url = client.url
    done = _permits(db_url, "db", "ping")
    assert done.stdout.startswith(f"{url} answered in "), done.stdout
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()  # a database, with no tables
    refused = _permits(f"sqlite:///{empty}", "db", "ping", check=False)
    assert refused.returncode == 1 and "schema_mismatch" in refused.stderr, refused.stderr
    with contextlib.closing(sqlite3.connect(empty)) as conn:  # still no tables
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == []
    missing = tmp_path / "missing.db"
    absent = _permits(f"sqlite:///{missing}", "db", "ping", check=False)
    assert absent.returncode == 1 and f"no SQLite database at {missing}" in absent.stderr, absent.stderr
    assert not missing.exists()  # a probe leaves no empty database for a later command to take
    closed = _permits("postgresql://postgres@127.0.0.1:1/nothing", "db", "ping", "--timeout", "1", check=False)
    assert closed.returncode == 1 and "storage_unavailable" in closed.stderr, closed.stderr
    bad = _permits(db_url, "db", "ping", "--timeout", "-1", check=False)
    assert bad.returncode == 2 and "--timeout" in bad.stderr, bad.stderr


def test_db_ping_of_a_service_needs_no_token(tmp_path: Path) -> None:
    """Through a service it asks readiness, which needs no token, as a load balancer does (opening the
    client first asked GET /v1/whoami, which does, and failed with unauthorized)."""
    tokens = [{"name": "ops", "token": "ping-admin-token-0123456789", "admin": True}]
    with running(f"sqlite:///{tmp_path / 'served.db'}", tokens=tokens) as service:
        env = {k: v for k, v in os.environ.items() if k != "PERMITS_TOKEN"}
        done = subprocess.run(
            [sys.executable, "-m", "permits", "db", "ping", "--db", service.url],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    assert done.returncode == 0 and "answered in" in done.stdout, done.stderr


def _revoke_the_holder(db_url: str, name: str, reason: str) -> None:
    """Revoke the one lease on ``name``, once there is one, as an administrator would."""
    _wait_until_held(db_url, name)
    with permits.connect(db_url) as client:
        [holder] = client.holders(name)
        client.revoke(holder.key, owner=holder.owner, reason=reason)


def test_run_exits_76_for_a_lease_lost_after_the_watchdogs_last_look(db_url: str, ns: str, tmp_path: Path) -> None:
    """A lease revoked between two of the watchdog's extends (every ttl/3: 20 s here), just before COMMAND
    ends: the release finds it ended, and permits says so and exits 76. It exited with COMMAND's status and
    said nothing, though part of COMMAND's work ran without the lease."""
    name, go = f"{ns}cron", tmp_path / "go"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    waits_for_go = f"while [ ! -e {go} ]; do sleep 0.05; done"
    run = _in_background(db_url, "run", name, "--ttl", "60", "--", "sh", "-c", waits_for_go)
    _revoke_the_holder(db_url, name, "host lost its disk")
    go.touch()
    assert run.wait(timeout=30) == 76
    assert run.stderr is not None
    told = run.stderr.read()
    assert "the lease was lost before the command ended" in told and "revoked" in told, told


def test_run_leaves_ignored_signals_ignored_as_nohup_asks(db_url: str, ns: str, tmp_path: Path) -> None:
    """Started with SIGHUP ignored (``nohup``), ``permits run`` is not stopped by one while it waits for
    permits, nor while COMMAND runs, and COMMAND inherits it ignored, as under flock(1). A handler made
    SIGHUP stop the wait (exit 129), and exec reset COMMAND's to the default action."""
    name, go, seen = f"{ns}cron", tmp_path / "go", tmp_path / "seen"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    code = (
        "import pathlib, signal, time\n"
        f"pathlib.Path({str(seen)!r}).write_text(str(int(signal.getsignal(signal.SIGHUP))))\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.05)\n"
    )
    with permits.connect(db_url) as client:
        blocker = client.acquire(name)
        run = subprocess.Popen(
            [sys.executable, "-m", "permits", "run", "-w", "60", name, "--", sys.executable, "-c", code],
            env={**os.environ, "PERMITS_DATABASE_URL": db_url},
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
        )
        time.sleep(1.0)  # waiting for room
        run.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        assert run.poll() is None, run.stderr.read() if run.stderr else ""
        client.release(blocker)
    deadline = time.monotonic() + 30
    while not seen.exists() or not seen.read_text():
        assert time.monotonic() < deadline and run.poll() is None, "COMMAND never started"
        time.sleep(0.05)
    assert seen.read_text() == str(int(signal.SIG_IGN))
    run.send_signal(signal.SIGHUP)
    time.sleep(0.3)
    go.touch()
    assert run.wait(timeout=30) == 0, run.stderr.read() if run.stderr else ""


def test_run_passes_its_open_file_descriptors_to_the_command(db_url: str, ns: str, tmp_path: Path) -> None:
    """``permits run NAME -- CMD 3>file`` as under flock(1): COMMAND writes to the descriptor it was given
    (Popen closed every descriptor above 2: "Bad file descriptor"), and has no other above 2."""
    name, out = f"{ns}cron", tmp_path / "out"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    command = "echo through-fd-3 >&3; ls /proc/$$/fd | sort -n | tr '\\n' ' ' >&3"
    line = shlex.join([sys.executable, "-m", "permits", "run", name, "--", "sh", "-c", command])
    done = subprocess.run(
        f"{line} 3>{shlex.quote(str(out))}",
        shell=True,
        env={**os.environ, "PERMITS_DATABASE_URL": db_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_text() == "through-fd-3\n0 1 2 3 "  # and none of those permits opened itself


def test_run_signals_the_command_for_a_lost_lease_even_when_stderr_is_gone(db_url: str, ns: str) -> None:
    """The loss's message is written after the signal is sent: a stderr that cannot be written (a reader
    gone, here) must not leave COMMAND working on unprotected until it ends by itself."""
    name = f"{ns}cron"
    _permits(db_url, "sem", "create", name, "--capacity", "1")
    run = _in_background(db_url, "run", name, "--ttl", "3", "--", "sleep", "60")
    _wait_until_held(db_url, name)
    assert run.stderr is not None
    run.stderr.close()  # nobody reads what permits run says any more: its writes fail (EPIPE)
    started = time.monotonic()
    _revoke_the_holder(db_url, name, "stop it")
    assert run.wait(timeout=45) == 76
    assert time.monotonic() - started < 20  # the next extend (ttl/3) finds the loss; sleep 60 is stopped


def test_run_checks_its_arguments_before_it_creates_or_waits(tmp_path: Path) -> None:
    """A bad --ttl, --key or count is exit 2 before anything is asked: no semaphore made by --create, and no
    wait through an outage first (``-w 30`` against a server that is not there)."""
    db_url = f"sqlite:///{tmp_path / 'p.db'}"
    for bad in (["--ttl", "0"], ["--key", ""], ["--owner", "x" * 300]):
        done = _permits(db_url, "run", "--create", "1", *bad, "made", "--", "true", check=False)
        assert done.returncode == 2 and "invalid_argument" in done.stderr, (bad, done.stderr)
    done = _permits(db_url, "run", "--create", "1", "made:0", "--", "true", check=False)
    assert done.returncode == 2 and "invalid_argument" in done.stderr, done.stderr
    with permits.connect(db_url) as client:
        assert client.list_semaphores() == []
    started = time.monotonic()
    away = "mysql://root@127.0.0.1:1/nothing"
    done = _permits(away, "run", "-w", "30", "--ttl", "-1", "m", "--", "true", check=False, timeout=40)
    assert done.returncode == 2 and "ttl" in done.stderr, done.stderr
    assert time.monotonic() - started < 15
