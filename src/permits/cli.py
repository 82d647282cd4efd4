"""The ``permits`` command: the library's operations from a shell, and ``permits run``, flock(1) for a fleet.

Every command takes ``--db URL`` (or ``$PERMITS_DATABASE_URL``; default ``sqlite:///permits.db``).
Exit codes: 0 success; 1 an operation failed (no room, not found, database error); 2 bad input;
``permits run`` exits with its command's status, or 75 when it could not acquire in time, or 76 when the
lease was lost while the command ran.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

import permits
from permits import _validate
from permits._backoff import OUTAGE_BACKOFF
from permits._config import DEFAULT_URL
from permits._deadline import caller_deadline
from permits._exceptions import (
    AcquireTimeout,
    ConfigurationError,
    InvalidArgument,
    KeyInUse,
    LeaseLost,
    PermitsError,
    SemaphoreExists,
    ServiceUnavailable,
    StorageUnavailable,
    UsageError,
)
from permits._io import monotonic
from permits._models import Want
from permits._sync.client import Client, Held

F = TypeVar("F", bound=Callable[..., Any])

#: The library's waits say what they wait for here; so does ``permits run``'s wait for the database.
client_logger = logging.getLogger("permits.client")

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_ACQUIRED = 75  # EX_TEMPFAIL: try again later
EXIT_LEASE_LOST = 76
#: The signals ``permits run`` passes on to COMMAND, so a supervisor can stop it cleanly.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _handled_signals() -> tuple[signal.Signals, ...]:
    """The forwarded signals this process was not started ignoring. One that was (``nohup``, a job started
    with ``&`` by a shell without job control) stays ignored, here and in COMMAND, which inherits it
    through exec as flock(1)'s and timeout(1)'s commands do; a handler would stop the run on it, and be
    reset to the default action in COMMAND."""
    return tuple(s for s in FORWARDED_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN)


#: The file of the default database, in the working directory.
DEFAULT_DATABASE_FILE = DEFAULT_URL.removeprefix("sqlite:///")
#: How long ``permits run`` tries to release the lease once COMMAND has ended. A database that hangs would
#: otherwise keep it there for minutes (every try waits for its reply, and a release is retried), after
#: the work it guarded is done; the lease then runs out at its TTL instead.
RELEASE_PATIENCE = 10.0
PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


#: Where ``permits --db URL COMMAND`` keeps the URL given before the command, for the command's own --db.
_GIVEN_FIRST = "permits.db"


def _db_given_first(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """A command's ``--db``: its own flag; else one given before the command (``permits --db URL sem ls``,
    as kubectl takes --context); else ``$PERMITS_DATABASE_URL`` (or, for serve and maintain, their config)."""
    source = ctx.get_parameter_source("db")
    given_first = ctx.find_root().meta.get(_GIVEN_FIRST)
    if given_first is not None and source is not click.core.ParameterSource.COMMANDLINE:
        return str(given_first)
    return value


def _db_option(fn: F) -> F:
    return click.option(
        "--db",
        "db",
        envvar="PERMITS_DATABASE_URL",
        default=None,
        metavar="URL",
        callback=_db_given_first,
        help="Database URL, or a permits service's http(s):// URL (token in $PERMITS_TOKEN)"
        " (default: $PERMITS_DATABASE_URL, else sqlite:///permits.db).",
    )(fn)


def _owner_option(fn: F) -> F:
    return click.option(
        "--owner", default=None, help="Owner that scopes lease keys (default: $PERMITS_OWNER, else user@host)."
    )(fn)


@contextmanager
def _client(
    db: str | None, owner: str | None = None, reach: Callable[[Client], None] | None = None
) -> Iterator[Client]:
    """A client whose errors become a one-line message and an exit code, never a traceback. ``reach``: how
    to reach the database before the client opens (``permits run``'s wait through an outage)."""
    if db is None and not os.environ.get("PERMITS_DATABASE_URL") and not os.path.exists(DEFAULT_DATABASE_FILE):
        # A host whose cron line lacks the variable would otherwise get a private database without a word,
        # and "one machine at a time" would quietly stop holding.
        click.echo(
            f"permits: no database named (--db, PERMITS_DATABASE_URL): making {DEFAULT_DATABASE_FILE} in"
            f" {os.getcwd()}, which only commands run in this directory share",
            err=True,
        )
    try:
        client = permits.connect(db, owner=owner)
        if reach is not None:
            try:
                reach(client)
            except BaseException:
                client.close()
                raise
        with client:
            yield client
    except (InvalidArgument, ConfigurationError) as exc:
        _fail(exc, EXIT_USAGE)
    except PermitsError as exc:
        _fail(exc, EXIT_FAILED)
    except KeyboardInterrupt:
        # Ctrl-C (a wait for room, say; the library has given up the call's places in fair queues): said as
        # `permits run` says it, with the shell's status for it, rather than click's "Aborted!" and 1.
        click.echo("permits: interrupted", err=True)
        sys.exit(128 + signal.SIGINT)


def _fail(exc: PermitsError, code: int) -> None:
    click.echo(f"permits: {exc.code}: {exc}", err=True)
    sys.exit(code)


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def parse_wants(specs: tuple[str, ...]) -> list[Want]:
    """``NAME`` or ``NAME:COUNT``; the last colon separates the count, so names may contain colons."""
    wants = []
    for spec in specs:
        name, sep, count = spec.rpartition(":")
        if sep and count.isascii() and count.isdigit() and name:  # not "²" or "٣", which int() reads oddly
            wants.append(Want(name, int(count)))
        else:
            wants.append(Want(spec, 1))
    return wants


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(permits.__version__, prog_name="permits")
@click.option(
    "--db",
    "db",
    default=None,
    metavar="URL",
    help="Database or service URL for the command that follows (as its own --db; that one wins if given too).",
)
@click.pass_context
def main(ctx: click.Context, db: str | None) -> None:
    """Distributed counting semaphores, mutexes and leases on a SQL database."""
    if db is not None:
        ctx.meta[_GIVEN_FIRST] = db
    if ctx.invoked_subcommand not in SERVING_COMMANDS and not logging.getLogger().handlers:
        library = logging.getLogger("permits")
        handler = _ToStderr()
        library.addHandler(handler)
        ctx.call_on_close(lambda: library.removeHandler(handler))  # main() may be called again, in-process


#: The commands that set up logging of their own (the service's structured logs).
SERVING_COMMANDS = frozenset({"serve", "maintain"})


class _ToStderr(logging.Handler):
    """The library's warnings (a lease lost, an extend that failed) on stderr as the CLI's own lines are,
    ``permits: ...``: with no handler, Python would print them bare. Through click, to the stderr of the
    moment (a test's, an embedding program's), as the CLI's other lines."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            click.echo(f"permits: {record.getMessage()}", err=True)
        except Exception:
            self.handleError(record)


# ------------------------------------------------------------------------------------------------- db


@main.group()
def db() -> None:
    """Manage the schema."""


@db.command("upgrade")
@_db_option
def db_upgrade(db: str | None) -> None:
    """Create the tables, or bring them up to this version's schema."""
    try:
        client = permits.connect(db, auto_upgrade=False)
        revision = client.upgrade_schema()
        client.close()
    except PermitsError as exc:
        _fail(exc, EXIT_USAGE if isinstance(exc, InvalidArgument | ConfigurationError) else EXIT_FAILED)
    click.echo(f"schema at revision {revision} ({client.url})")


def _wait_seconds(_ctx: click.Context, _param: click.Parameter, value: float | None) -> float | None:
    """A --timeout (-w): a number of seconds >= 0, or ``None`` (and ``inf``) for no bound. Anything else is a
    usage error, before anything is asked: a NaN or a negative wait compared as none at all (``-w -1`` ran
    COMMAND as ``-n`` would), and ``inf`` overflowed the waits it was added to."""
    if value is None or value == math.inf:
        return None
    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(f"{value:g} is not a number of seconds >= 0 (or inf)")
    return value


@db.command("ping")
@click.option(
    "--timeout",
    type=float,
    default=10.0,
    show_default=True,
    callback=_wait_seconds,
    help="Give up soon after this many seconds, over a link that hangs too (a lock wait and 5 s after it,"
    ' and at least 15 s, with the defaults: docs/deployment.md, "A link that hangs").',
)
@_db_option
def db_ping(timeout: float | None, db: str | None) -> None:
    """Check that the database (or the service) answers, with the schema this version needs: exit 0, or 1
    with the error. For scripts and exec probes; it makes no tables, and no SQLite file."""
    started = monotonic()
    try:
        client = permits.connect(db, auto_upgrade=False)
        try:
            written = _sqlite_file(client.url)
            if written is not None and not os.path.exists(written):
                # Asked, SQLite would make an empty database, which a later command would take for the one
                # meant: a probe must not leave one behind.
                raise StorageUnavailable(f"no SQLite database at {os.path.abspath(written)}", url=client.url)
            # Not the client's context manager: it opens the client first (a service's GET /v1/whoami needs a
            # token, which readiness does not), outside the ping's timeout.
            client.ping(timeout=timeout)
        finally:
            client.close()
    except PermitsError as exc:
        _fail(exc, EXIT_USAGE if isinstance(exc, InvalidArgument | ConfigurationError | UsageError) else EXIT_FAILED)
    click.echo(f"{client.url} answered in {(monotonic() - started) * 1000:.0f} ms")


def _sqlite_file(url: str) -> str | None:
    """The file a SQLite URL names (``None`` for another database, or an in-memory one)."""
    if not url.startswith("sqlite"):
        return None  # a server's, or a service's: the CLI through a service never imports SQLAlchemy
    from sqlalchemy.engine import make_url

    from permits.dialects.sqlite import database_file

    return database_file(make_url(url))


@db.command("drop-old-functions")
@click.option("--dry-run", is_flag=True, help="List them, and drop nothing.")
@_db_option
def db_drop_old_functions(dry_run: bool, db: str | None) -> None:
    """Drop the server functions of other versions of permits (PostgreSQL).

    Each version makes functions of its own, named after a hash of their definition, and leaves the
    others' in place for clients that still run them. Run this once none does (a client of another
    version would go on without them, slower), with the newest version of permits, as the clients' role.
    """
    try:
        with permits.connect(db, auto_upgrade=False) as client:
            dropped = client.drop_old_functions(dry_run=dry_run)
    except PermitsError as exc:
        _fail(exc, EXIT_USAGE if isinstance(exc, InvalidArgument | ConfigurationError | UsageError) else EXIT_FAILED)
    for function in dropped:
        click.echo(f"{'would drop' if dry_run else 'dropped'} {function}")
    if not dropped:
        click.echo("no server functions of other versions of permits")


# ------------------------------------------------------------------------------------------ semaphores


#: The ``--timeout`` of the commands that do not wait for room (``release``, ``sem ls``, ...).
_call_timeout_option = click.option(
    "--timeout",
    type=float,
    default=None,
    callback=_wait_seconds,
    help="Give up soon after this many seconds, over a link that hangs too (exit 1, storage_unavailable:"
    " the call may or may not have been made)  [default: the store's own bounds]",
)


def _within(timeout: float | None) -> caller_deadline:
    """A command's ``--timeout``, for everything it asks, the client's opening included."""
    return caller_deadline(None if timeout is None else monotonic() + timeout)


@main.group()
def sem() -> None:
    """Create, change, list, show and delete semaphores."""


@sem.command("create")
@click.argument("name")
@click.option("--capacity", type=int, required=True, help="How many permits it holds.")
@click.option("--exist-ok", is_flag=True, help="Succeed if it exists already with the same capacity.")
@click.option("--fair", is_flag=True, help="Serve waiting acquires in arrival order.")
@_call_timeout_option
@_db_option
def sem_create(name: str, capacity: int, exist_ok: bool, fair: bool, timeout: float | None, db: str | None) -> None:
    """Create semaphore NAME."""
    with _within(timeout), _client(db) as client:
        _echo_json(client.create_semaphore(name, capacity, exist_ok=exist_ok, fair=fair).to_dict())


@sem.command("rwlock")
@click.argument("name")
@click.option("--exist-ok", is_flag=True, help="Succeed if it exists already.")
@_call_timeout_option
@_db_option
def sem_rwlock(name: str, exist_ok: bool, timeout: float | None, db: str | None) -> None:
    """Create a read-write lock NAME (take it with NAME:1 to read, NAME:1000000 to write)."""
    with _within(timeout), _client(db) as client:
        _echo_json(client.create_rwlock(name, exist_ok=exist_ok).to_dict())


@sem.command("set")
@click.argument("name")
@click.option("--capacity", type=int, required=True)
@click.option("--reason", required=True, help="Why: kept in the capacity history.")
@_call_timeout_option
@_db_option
def sem_set(name: str, capacity: int, reason: str, timeout: float | None, db: str | None) -> None:
    """Change the capacity of NAME (lowering it revokes nothing)."""
    with _within(timeout), _client(db) as client:
        _echo_json(client.set_capacity(name, capacity, reason=reason).to_dict())


@sem.command("ls")
@click.option("--prefix", default="", help="Only names that start with this.")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
@_call_timeout_option
@_db_option
def sem_ls(prefix: str, as_json: bool, timeout: float | None, db: str | None) -> None:
    """List semaphores."""
    with _within(timeout), _client(db) as client:
        sems = client.list_semaphores(prefix)
    if as_json:
        _echo_json([s.to_dict() for s in sems])
        return
    width = max([4, *(len(s.name) for s in sems)])
    click.echo(f"{'NAME':<{width}}  {'USED':>8}  {'CAPACITY':>8}  {'LAST TOKEN':>10}")
    for s in sems:
        click.echo(f"{s.name:<{width}}  {s.used:>8}  {s.capacity:>8}  {s.last_token:>10}")


@sem.command("show")
@click.argument("name")
@_call_timeout_option
@_db_option
def sem_show(name: str, timeout: float | None, db: str | None) -> None:
    """Show NAME: capacity, use, holders, waiters (fair mode) and capacity history."""
    with _within(timeout), _client(db) as client:
        info = client.get_semaphore(name).to_dict()
        info["holders"] = [h.to_dict() for h in client.holders(name)]
        info["waiters"] = [w.to_dict() for w in client.waiters(name)]
        info["capacity_history"] = [c.to_dict() for c in client.capacity_history(name, limit=20)]
    _echo_json(info)


@sem.command("rm")
@click.argument("name")
@click.option("--force", is_flag=True, help="Revoke the leases that hold permits of it.")
@_call_timeout_option
@_db_option
def sem_rm(name: str, force: bool, timeout: float | None, db: str | None) -> None:
    """Delete NAME (refused while permits are held, unless --force)."""
    with _within(timeout), _client(db) as client:
        revoked = client.delete_semaphore(name, force=force)
    click.echo(f"deleted {name}" + (f"; revoked {revoked} lease(s)" if revoked else ""))


# -------------------------------------------------------------------------------------------- leases


@main.command()
@click.argument("wants", nargs=-1, required=True, metavar="NAME[:COUNT]...")
@click.option("--key", required=True, help="Idempotency key: the same key never grants twice.")
@click.option(
    "--ttl", type=float, default=None, help="Lease TTL in seconds (default 60, or through a service the service's)."
)
@click.option(
    "--timeout", type=float, default=0.0, show_default=True, callback=_wait_seconds, help="Seconds to wait for room."
)
@click.option(
    "--new-only", is_flag=True, help="Refuse a KEY that names a lease already (key_in_use), instead of printing it."
)
@_owner_option
@_db_option
def acquire(
    wants: tuple[str, ...],
    key: str,
    ttl: float | None,
    timeout: float,
    new_only: bool,
    owner: str | None,
    db: str | None,
) -> None:
    """Acquire permits of one or more semaphores, all or nothing; prints the lease as JSON."""
    with _client(db, owner) as client:
        try:
            lease = client.acquire(parse_wants(wants), key=key, ttl=ttl, timeout=timeout, new_only=new_only)
        except (AcquireTimeout, KeyInUse) as exc:
            _fail(exc, EXIT_FAILED)
        _echo_json(lease.to_dict())


@main.command()
@click.argument("key")
@_call_timeout_option
@_owner_option
@_db_option
def release(key: str, timeout: float | None, owner: str | None, db: str | None) -> None:
    """Release the lease KEY: prints released, already_released, lost or not_found."""
    with _within(timeout), _client(db, owner) as client:
        outcome = client.release(key, timeout=timeout)
    click.echo(str(outcome))
    if outcome is permits.ReleaseOutcome.NOT_FOUND:
        sys.exit(EXIT_FAILED)


@main.command()
@click.argument("key")
@click.option("--ttl", type=float, default=None, help="New TTL in seconds, from now  [default: the lease's own TTL]")
@_call_timeout_option
@_owner_option
@_db_option
def extend(key: str, ttl: float | None, timeout: float | None, owner: str | None, db: str | None) -> None:
    """Extend the lease KEY by its own TTL, or by --ttl this once; prints it as JSON."""
    with _within(timeout), _client(db, owner) as client:
        _echo_json(client.extend(key, ttl, timeout=timeout).to_dict())


@main.command("lease")
@click.argument("key")
@_call_timeout_option
@_owner_option
@_db_option
def show_lease(key: str, timeout: float | None, owner: str | None, db: str | None) -> None:
    """Show the lease KEY as JSON."""
    with _within(timeout), _client(db, owner) as client:
        _echo_json(client.get_lease(key).to_dict())


@main.command()
@click.argument("key")
@click.option("--reason", required=True, help="Why: kept with the lease, and in the service's admin log.")
@_call_timeout_option
@_owner_option
@_db_option
def revoke(key: str, reason: str, timeout: float | None, owner: str | None, db: str | None) -> None:
    """End the lease KEY of --owner now, as an administrator (its holder learns it at its next extend);
    prints the lease as JSON. `permits sem show NAME` lists holders' owners and keys."""
    with _within(timeout), _client(db, owner) as client:
        _echo_json(client.revoke(key, reason=reason, timeout=timeout).to_dict())


@main.command()
@click.option("--batch-size", type=int, default=500, show_default=True)
@click.option(
    "--timeout",
    type=float,
    default=None,
    callback=_wait_seconds,
    help="Start no batch after this many seconds, and say whether the sweep was complete; over a link that"
    " hangs, give up soon after it (exit 1, storage_unavailable)  [default: sweep until none is left]",
)
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a line: leases, batches, keys, complete.")
@_db_option
def sweep(batch_size: int, timeout: float | None, as_json: bool, db: str | None) -> None:
    """End every expired lease, in short batches."""
    with _within(timeout), _client(db) as client:
        result = client.sweep(batch_size=batch_size, timeout=timeout)
    if as_json:
        _echo_json(result.to_dict())
        return
    click.echo(f"swept {result.leases} lease(s) in {result.batches} batch(es)")
    if not result.complete:
        click.echo("stopped at --timeout: more leases may be expired (sweep again to go on)", err=True)


#: How ``permits reconcile`` names each kind of drift (Drift.field)
_DRIFT_FIELDS = {
    "used": "permits in use",
    "last_token": "last token",
    "orphaned_permits": "permit rows without a lease",
    "last_ticket": "last queue ticket",
}


@main.command()
@click.option(
    "--repair",
    is_flag=True,
    help="Fix what drifted: true counts, token and ticket counters (only raised), orphaned permit rows.",
)
@click.option(
    "--timeout",
    type=float,
    default=None,
    callback=_wait_seconds,
    help="Start no repair after this many seconds (the drift left is shown unrepaired, exit 1); the check's"
    " read, over a link that hangs, gives up soon after it (exit 1, storage_unavailable)  [default: the store's"
    " own bounds]",
)
@click.option("--json", "as_json", is_flag=True, help="JSON instead of lines: a list of drift, [] for none.")
@_db_option
def reconcile(repair: bool, timeout: float | None, as_json: bool, db: str | None) -> None:
    """Check each semaphore's count, token counter and queue's ticket counter against its rows; exit 1 if
    drift remains."""
    with _within(timeout), _client(db) as client:
        drift = client.reconcile(repair=repair, timeout=timeout)
    if as_json:
        _echo_json([d.to_dict() for d in drift])
    else:
        for d in drift:
            state = "repaired" if d.repaired else "DRIFT"
            what = _DRIFT_FIELDS.get(d.field, d.field)
            click.echo(f"{state}: {d.name}: {what} recorded {d.recorded}, actual {d.actual}")
        if not drift:
            click.echo("no drift")
    if not all(d.repaired for d in drift):  # a check's, or what a repair's --timeout left
        sys.exit(EXIT_FAILED)


# ---------------------------------------------------------------------------------------------- run


class _RunCommand(click.Command):
    """``permits run``'s parser: everything after the first ``--`` is COMMAND, kept whole.

    click would read COMMAND's own options (``sh -c``, ``rsync --delete``) as ours, and it drops the
    ``--`` itself, so the split is made here, on the arguments this command was given, before click
    parses the rest: the same whether they came from the shell or from ``main([...])`` in Python.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            at = args.index("--")
            ctx.meta["permits.run.command"] = args[at + 1 :]
            args = args[:at]
        return super().parse_args(ctx, args)


def _seconds(value: float) -> float:
    """A finite, non-negative number of seconds, or a usage error."""
    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(f"{value:g} is not a number of seconds >= 0")
    return value


def _kill_after(_ctx: click.Context, _param: click.Parameter, value: float) -> float | None:
    """--kill-after in seconds, None for never (-1). Anything else that is not a finite, non-negative
    number of seconds is a usage error: a NaN would never compare as due, and the command would keep
    running on a lost lease."""
    if value == -1:
        return None
    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(f"{value:g} is not a number of seconds >= 0, or -1 for never")
    return value


@main.command(cls=_RunCommand)
@click.argument("wants", nargs=-1, metavar="NAME[:COUNT]... -- COMMAND [ARGS]...")
@click.pass_context
@click.option(
    "--ttl",
    type=float,
    default=None,
    help="Lease TTL; renewed every ttl/3 (default 60, or through a service the service's default).",
)
@click.option(
    "-w",
    "--timeout",
    type=float,
    default=None,
    callback=_wait_seconds,
    help="Seconds to wait for room (default: for ever), as flock's -w.",
)
@click.option("-n", "--nonblock", is_flag=True, help="Do not wait: the same as --timeout 0, as flock's -n.")
@click.option(
    "--create",
    "create_capacity",
    type=click.IntRange(1),
    default=None,
    metavar="CAPACITY",
    help="Create each semaphore that does not exist with CAPACITY permits first, as flock creates its lock"
    " file. One that exists with another capacity is an error; its fair mode does not matter.",
)
@click.option(
    "--key",
    default=None,
    help="Names the lease; a key that names one already is refused. Keys are per owner (user@host by default):"
    " runs on several hosts that must exclude each other by key need the same --owner. (Default: a new key.)",
)
@click.option(
    "-E",
    "--conflict-exit-code",
    type=click.IntRange(0, 255),
    default=EXIT_NOT_ACQUIRED,
    show_default=True,
    help="Exit status when no permit could be had within --timeout, or --key names a lease already.",
)
@click.option(
    "--max-hold",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Keep the lease alive at most this many seconds (default: no cap).",
)
@click.option(
    "--on-lost-signal",
    type=click.Choice(["TERM", "INT", "HUP", "KILL", "USR1", "USR2", "NONE"]),
    default="TERM",
    show_default=True,
    help="Signal COMMAND gets when the lease is lost (NONE: let it finish; permits still exits 76).",
)
@click.option(
    "--kill-after",
    type=float,
    default=10.0,
    show_default=True,
    help="SIGKILL COMMAND if it still runs this many seconds after its --on-lost-signal (-1: never).",
    callback=_kill_after,
)
@_owner_option
@_db_option
def run(
    ctx: click.Context,
    wants: tuple[str, ...],
    ttl: float | None,
    timeout: float | None,
    nonblock: bool,
    create_capacity: int | None,
    key: str | None,
    conflict_exit_code: int,
    max_hold: float | None,
    on_lost_signal: str,
    kill_after: float | None,
    owner: str | None,
    db: str | None,
) -> None:
    """Hold permits while COMMAND runs: flock(1) for a fleet.

    Waits for the permits, runs COMMAND, keeps the lease alive with a watchdog (an extend every ttl/3),
    releases it when COMMAND ends and exits with COMMAND's status. If the lease is lost (revoked, released
    by maintenance, expired while the database was unreachable, or past --max-hold), COMMAND gets
    --on-lost-signal at once, SIGKILL --kill-after seconds later if it still runs, and permits exits 76
    when it ends. COMMAND finds its lease's key in $PERMITS_LEASE_KEY and its fencing token in
    $PERMITS_FENCING_TOKEN (one semaphore) and $PERMITS_FENCING_TOKENS (JSON, by semaphore).
    """
    command: list[str] | None = ctx.meta.get("permits.run.command")
    if command is None:
        raise click.UsageError("put -- between the semaphores and the command: permits run NAME -- CMD")
    specs = list(wants)
    if not specs or not command:
        raise click.UsageError("permits run needs NAME[:COUNT]... -- COMMAND")
    if nonblock:
        if timeout not in (None, 0):
            raise click.UsageError("-n/--nonblock means --timeout 0: give one or the other")
        timeout = 0.0
    options = _RunOptions(
        ttl=ttl,
        timeout=timeout,
        key=key,
        conflict_exit_code=conflict_exit_code,
        max_hold=max_hold,
        on_lost_signal=on_lost_signal,
        kill_after=kill_after,
    )
    given = _given_descriptors()  # before permits opens any of its own
    parsed = parse_wants(tuple(specs))
    _check_run_arguments(parsed, options, owner)
    started = monotonic()
    with _client(db, owner, lambda client: _reach_through_an_outage(client, parsed, options.timeout)) as client:
        if options.timeout is not None:  # one --timeout for the wait for the database and the wait for room
            options = replace(options, timeout=max(0.0, options.timeout - (monotonic() - started)))
        if create_capacity is not None:
            for want in parsed:
                _create_unless_there(client, want.name, create_capacity)
        status, lost = _run_holding(client, parsed, command, replace(options, descriptors=given))
    if lost:
        sys.exit(EXIT_LEASE_LOST)
    sys.exit(status if status >= 0 else 128 - status)


def _check_run_arguments(wants: list[Want], options: _RunOptions, owner: str | None) -> None:
    """What the lease's request will check, checked before anything is asked: a bad --ttl must not wait
    out an outage first, nor follow a --create that made the semaphore."""
    try:
        _validate.wants(wants)
        if options.key is not None:
            _validate.key(options.key)
        if owner is not None:
            _validate.owner(owner)
        if options.ttl is not None:
            _validate.ttl_ms(options.ttl)
        _validate.max_hold(options.max_hold)
    except InvalidArgument as exc:
        _fail(exc, EXIT_USAGE)


def _create_unless_there(client: Client, name: str, capacity: int) -> None:
    """``run --create``: the semaphore made without fair mode if missing. One that exists with this capacity
    is used whatever its mode: the run does not choose it (a read-write lock, or a semaphore made fair at
    setup, is fair). One with another capacity is an error, as a typo in a cron line would be."""
    try:
        client.create_semaphore(name, capacity, exist_ok=True)
    except SemaphoreExists:
        if client.get_semaphore(name).capacity != capacity:
            raise


def _reach_through_an_outage(client: Client, wants: list[Want], timeout: float | None) -> None:
    """Reach the database (or the service) first, waiting through an outage within ``timeout`` (``None``:
    for ever), as the wait for room does: a cron line that starts while the database restarts or fails over
    then runs once it is back, rather than exit 1. The library's own opening fails at once, since a
    database that never answered cannot be told from a wrong URL; here the caller said how long to wait,
    and the warning says what it waits for. ``-n`` (a timeout of 0) still fails at once, and so does SQLite:
    an embedded database has no outage to wait out, and a file that cannot be opened is a wrong path. A
    stop (Ctrl-C, a supervisor's SIGTERM) meanwhile is said and exits as one while waiting for room does."""
    deadline = None if timeout is None else monotonic() + timeout
    rides_out = timeout != 0 and not client.url.startswith("sqlite")

    def stop(signum: int, _frame: object) -> None:
        raise _Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in _handled_signals()}
    try:
        outages = 0
        while True:
            try:
                # Each attempt within the timeout too, not the store's retries' whole length (a link that
                # hangs made `--timeout 3` wait minutes for the first attempt to fail).
                with caller_deadline(deadline):
                    client.ping()
            except (StorageUnavailable, ServiceUnavailable) as exc:
                remaining = None if deadline is None else deadline - monotonic()
                if not rides_out or (remaining is not None and remaining <= 0):
                    raise
                if not outages:
                    described = ", ".join(f"{w.name}:{w.count}" for w in wants)
                    until = "it answers" if timeout is None else f"the timeout ({timeout:g} s)"
                    client_logger.warning(
                        "waiting for %s through an outage: %s; asking again until %s", described, exc.message, until
                    )
                pause = OUTAGE_BACKOFF.delay(outages)
                outages += 1
                time.sleep(pause if remaining is None else min(pause, remaining))
                continue
            if outages:
                client_logger.info("reached the database after %d attempts", outages + 1)
            return
    except _Stopped as stopped:
        _exit_stopped(stopped.signum)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@dataclass(frozen=True)
class _RunOptions:
    ttl: float | None
    timeout: float | None
    key: str | None
    conflict_exit_code: int
    max_hold: float | None
    on_lost_signal: str
    #: seconds from the loss signal to SIGKILL; None: never
    kill_after: float | None
    #: the inheritable file descriptors above 2 this process was given, which COMMAND inherits
    descriptors: tuple[int, ...] = ()


def _run_holding(client: Client, wants: list[Want], command: list[str], options: _RunOptions) -> tuple[int, bool]:
    """``permits run`` once its arguments are read: COMMAND's status, and whether the lease was lost."""
    child: subprocess.Popen[bytes] | None = None
    starting = False  # COMMAND's process is being made: it may run before ``child`` is known
    releasing = False  # the lease is being given back: no signal may cut that short
    held_back: list[int] = []  # signals to pass on to COMMAND that came while it was being made
    stopping: list[float] = []  # when COMMAND was sent its signal for a lost lease
    signalled: list[_Process] = []  # the processes below COMMAND that got it: they must end too
    passed_on: list[_Process] = []  # the processes below COMMAND that got a signal passed on: waited for
    stopped: list[int] = []  # the signal that stopped this run before COMMAND started

    lost_at_release: list[LeaseLost] = []  # the release found the lease ended before COMMAND did
    loss_lock = threading.Lock()  # the watchdog's thread and the main one each may send the loss's signal
    loss_sent: list[bool] = []  # it was sent: once only (a second would cut a clean shutdown short)

    def signal_the_loss() -> None:
        """Send the lost lease's signal to COMMAND and every process below it, once, from whichever thread
        finds both the loss and COMMAND first: the watchdog's (``on_lost``), or the main one just after it
        started COMMAND (a loss while COMMAND's process was being made). When it goes out, ``stopping``
        starts the --kill-after clock, and each process goes on ``signalled`` before its signal: a shell
        that dies of it returns the main thread's wait at once, and a job missing from either was never
        killed (it ran on, unprotected, after permits run ended)."""
        with loss_lock:
            if loss_sent or child is None or child.poll() is not None:
                return
            loss_sent.append(True)
            stopping.append(monotonic())
            _signal_the_command(child, getattr(signal, f"SIG{options.on_lost_signal}"), signalled)

    def on_lost(why: str) -> None:
        if options.on_lost_signal == "NONE":
            _say(f"permits: lease lost while the command ran ({why})")
            return
        # The signal first: a stderr that cannot be written (a closed pipe, a full disk) must not leave
        # COMMAND working on unprotected.
        signal_the_loss()
        _say(f"permits: lease lost while the command ran ({why}); sending SIG{options.on_lost_signal}")
        signum = getattr(signal, f"SIG{options.on_lost_signal}")
        with loss_lock:
            if child is not None and not stopping:  # COMMAND had ended: those it left get the signal below
                stopping.append(monotonic())
        for process in passed_on:  # a process that outlived COMMAND, still waited for: it must stop too
            if process not in signalled and process.running():
                signalled.append(process)
                process.signal(signum)

    def on_signal(signum: int, _frame: object) -> None:
        # One handler from the first request to the end, so that no signal finds the default one (which
        # would end this process with the lease held) between waiting and COMMAND's start.
        if releasing:
            return
        if child is not None or starting:
            # A terminal's Ctrl-C (SIGINT) or hang-up (SIGHUP) reaches its whole foreground process group,
            # COMMAND included: sent again, many commands would take it for a second Ctrl-C and skip their
            # clean shutdown. Anything else (a supervisor's SIGTERM to this process) is passed on. While
            # COMMAND's process is being made it is passed on once that is done: COMMAND may run already
            # (Popen returns after its exec), and stopping the run there would leave it to die by SIGKILL.
            if not (signum != signal.SIGTERM and _in_the_terminals_foreground()):
                if child is None:
                    held_back.append(signum)
                elif child.poll() is None:
                    _signal_the_command(child, signum, passed_on)
                else:  # COMMAND has ended, and its pid may be another's: those it left, still waited for
                    for process in passed_on:
                        process.signal(signum)
            return
        if not stopped:  # the first stops the run; the rest must not cut short the release that follows
            stopped.append(signum)
            raise _Stopped(signum)

    entered: Held | None = None  # the lease's context manager, once it is asked for the lease

    def stop_run(signum: int) -> NoReturn:
        """Stop before COMMAND started: give back the lease if its grant came back (a signal just after it
        would otherwise leave it held until its TTL), and exit as stopped."""
        nonlocal releasing
        if entered is not None and entered.lease is not None and not releasing:
            releasing = True
            with suppress(PermitsError):
                entered.__exit__(None, None, None)
        _exit_stopped(signum)

    previous = {s: signal.signal(s, on_signal) for s in _handled_signals()}
    try:
        # The lease's own context manager: its watchdog counts the lease's deadline from the request that
        # got it, and a stop while waiting releases by key whatever the grant became (but under --key).
        # A key names one request: a second run given a key whose lease exists would get that lease back,
        # as a retry does, and run its command beside the first. So a run asks for a new lease only, which
        # the database decides as it grants: two runs started at once cannot both pass.
        held = client.lease(
            wants,
            key=options.key,
            ttl=options.ttl,
            timeout=options.timeout,
            max_hold=options.max_hold,
            on_lost=on_lost,
            new_only=options.key is not None,
        )
        entered = held
        try:
            lease = held.__enter__()
        except AcquireTimeout as exc:
            click.echo(f"permits: {exc}", err=True)
            sys.exit(options.conflict_exit_code)
        except KeyInUse as exc:
            _refuse_a_used_key(exc, options.conflict_exit_code)
        except _Stopped as stop:  # while waiting, or just as the grant came back
            stop_run(stop.signum)
        try:
            environment, before_exec = _command_environment(lease), _die_with_this_process()
            # From here a terminal's Ctrl-C that comes before the fork is lost (it is not passed on, and
            # COMMAND did not exist to get it): a second one stops COMMAND. The window is Popen's own.
            starting = True
            try:
                child = _start(command, environment, before_exec, options.descriptors)
            except OSError as exc:
                click.echo(f"permits: cannot run {command[0]!r}: {exc}", err=True)
                sys.exit(126 if isinstance(exc, PermissionError) else 127)
            finally:
                starting = False
            for signum in held_back:
                _signal_the_command(child, signum, passed_on)
            if held.lost and options.on_lost_signal != "NONE":  # lost as COMMAND started (else on_lost sends it)
                signal_the_loss()
            status = _wait_for(child, stopping, signalled, options.kill_after, passed_on)
        except _Stopped as stop:  # granted, and stopped before COMMAND started: released below
            _exit_stopped(stop.signum)
        finally:
            releasing = True
            try:
                _release_within(held, RELEASE_PATIENCE)
            except LeaseLost as exc:
                # Lost while COMMAND ran: said already (the watchdog found it), and the exit status says it
                # (76). Or lost after the watchdog's last look and before COMMAND ended (revoked, say):
                # found only now, and said now, as 76 too. (One that ran out only after COMMAND ended, an
                # extend held up past the TTL, is not raised: held for all its run.)
                if not held.lost and child is not None:  # (a run stopped before COMMAND ran lost nothing)
                    lost_at_release.append(exc)
                    _say(f"permits: the lease was lost before the command ended ({exc})")
            except PermitsError as exc:
                # COMMAND has run: its status is the outcome. The lease runs out at its TTL instead.
                click.echo(f"permits: could not release the lease (it expires at its TTL): {exc.code}: {exc}", err=True)
            except TimeoutError:
                click.echo(
                    f"permits: could not release the lease within {RELEASE_PATIENCE:g} s (the database did not"
                    " answer); it expires at its TTL",
                    err=True,
                )
    except _Stopped as stop:  # before the lease was asked for (the check of --key), or as its grant came back
        stop_run(stop.signum)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return status, held.lost or bool(lost_at_release)


def _say(message: str) -> None:
    """A line on stderr, as far as stderr can take it: none of ``permits run``'s duties waits on it."""
    with suppress(OSError):
        click.echo(message, err=True)


def _release_within(held: Held, seconds: float) -> None:
    """Leave the lease's block (stop its watchdog, release the lease), for ``seconds`` at most: on a thread
    of its own, which the process's exit ends if the database keeps it (``TimeoutError``)."""
    failed: list[BaseException] = []
    done = threading.Event()

    def release() -> None:
        try:
            held.__exit__(None, None, None)
        except BaseException as exc:  # to the caller's thread
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=release, name="permits-release", daemon=True).start()
    if not done.wait(seconds):
        raise TimeoutError
    if failed:
        raise failed[0]


class _Stopped(BaseException):
    """A signal to stop (Ctrl-C, a supervisor's SIGTERM) came before COMMAND started. A BaseException,
    like the KeyboardInterrupt it stands for, so that the lease's context manager releases by key whatever
    the grant became, before ``permits run`` exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _exit_stopped(signum: int) -> NoReturn:
    if signum == signal.SIGINT:
        click.echo("permits: interrupted while waiting for permits", err=True)
    else:
        click.echo(f"permits: stopped by {signal.Signals(signum).name} while waiting for permits", err=True)
    sys.exit(128 + signum)


def _refuse_a_used_key(refused: KeyInUse, exit_code: int) -> NoReturn:
    """The lease under ``--key`` exists already: held by another ``permits run --key`` (or one that was
    killed, until its TTL), or ended, since a key is one request and is not granted twice."""
    key = refused.details.get("key")
    if refused.details.get("held"):
        why = f"is held already, by another `permits run --key {key}` or one that ended without releasing it"
    else:
        why = "was used already, by a run that has ended (a key is one request: choose a new one)"
    click.echo(f"permits: a lease under key {key!r} {why}", err=True)
    sys.exit(exit_code)


def _wait_for(
    child: subprocess.Popen[bytes],
    stopping: list[float],
    signalled: list[_Process],
    kill_after: float | None,
    passed_on: list[_Process],
) -> int:
    """COMMAND's status. Once it was sent its signal for a lost lease, it has ``kill_after`` seconds to
    end before SIGKILL, and so has every process below it that got the signal, also once COMMAND ended (a
    shell that died of the signal leaves its jobs to init): none may work on unprotected. The processes
    below it that got a signal passed on (a supervisor's SIGTERM) are waited for too, however long they
    take, with the lease held: ``sh -c 'job; next'`` dies of SIGTERM at once, and ``job`` may still be
    finishing its work, which the permits protect."""
    killed = False
    status: int | None = None
    told = False
    while True:
        if status is None:
            with suppress(subprocess.TimeoutExpired):  # the watchdog's thread may send the signal at any time
                status = child.wait(timeout=0.2)
        else:
            time.sleep(0.05)
        running = [p for p in signalled if p.running()]
        finishing = [p for p in passed_on if p.running()]
        if status is not None and finishing and not told and not stopping:
            click.echo(
                f"permits: the command ended; {len(finishing)} process(es) it started, which got the signal"
                " too, still run: the permits stay held until they end",
                err=True,
            )
            told = True
        signalled_gone = not running or killed or kill_after is None or not stopping
        # Those that got a passed-on signal are waited for, unless a lost lease's SIGKILL went out (or never will).
        finished = not finishing or (stopping and (killed or kill_after is None))
        if status is not None and signalled_gone and finished:
            return status
        if stopping and not killed and kill_after is not None and monotonic() - stopping[0] >= kill_after:
            what = "the command still ran" if status is None else "processes the command started still ran"
            click.echo(f"permits: {what} {kill_after:g} s after its signal: SIGKILL", err=True)
            if status is None:
                _signal_the_command(child, signal.SIGKILL, running)
            # Those a passed-on signal reached after the loss's went out are no longer waited for: killed too.
            for process in running + finishing:
                process.kill()
            killed = True


@dataclass(frozen=True)
class _Process:
    """A process below COMMAND, by its pid and its start time: a pid alone may be another's by now."""

    pid: int
    started: int  # clock ticks after boot (field 22 of /proc/PID/stat)

    def running(self) -> bool:
        found = _stat(self.pid)
        return found is not None and found[2] == self.started and found[1] != "Z"  # a zombie has ended

    def signal(self, signum: int) -> None:
        if self.running():
            with suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)


def _start(
    command: list[str], environment: dict[str, str], before_exec: Callable[[], None] | None, given: tuple[int, ...]
) -> subprocess.Popen[bytes]:
    """COMMAND, started. A file the kernel will not run (a script without ``#!``) is run with /bin/sh, as
    execvp(3) does, and so flock(1), env(1) and every shell: Popen's own exec does not. COMMAND inherits
    the file descriptors this process was given (``3>file``, make's jobserver, systemd's sockets), as under
    flock(1), and only those: not one a driver opened since (libpq marks its socket close-on-exec only after
    making it, and a watchdog's reconnect may be between the two as COMMAND forks)."""
    given = tuple(fd for fd in given if _still_inheritable(fd))
    try:
        return subprocess.Popen(command, env=environment, preexec_fn=before_exec, pass_fds=given)
    except OSError as exc:
        if exc.errno != errno.ENOEXEC:
            raise
        found = shutil.which(command[0], path=environment.get("PATH")) if "/" not in command[0] else command[0]
        return subprocess.Popen(
            ["/bin/sh", found or command[0], *command[1:]], env=environment, preexec_fn=before_exec, pass_fds=given
        )


def _given_descriptors() -> tuple[int, ...]:
    """The inheritable file descriptors above 2 open now (at ``permits run``'s start: those it was given)."""
    try:
        opened = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: the range a shell's redirections use
        opened = list(range(3, 10))
    return tuple(fd for fd in sorted(opened) if fd > 2 and _still_inheritable(fd))


def _still_inheritable(fd: int) -> bool:
    try:
        return os.get_inheritable(fd)
    except OSError:  # closed (the listing's own descriptor, or one closed since)
        return False


def _signal_the_command(child: subprocess.Popen[bytes], signum: int, tracked: list[_Process]) -> None:
    """Send a lost lease's signal (or its SIGKILL) to COMMAND and every process below it, having added those
    below to ``tracked`` first (another thread may read it as soon as COMMAND dies). None of them may work
    on unprotected, and a shell would not pass the signal on (``sh -c 'job; next'`` dies of SIGTERM and
    leaves ``job`` running). The tree is read first, since a process that dies has its children moved to
    init. As systemd signals a unit's every process. One started in the meantime, or that left the tree
    before (a daemon), is not reached."""
    below = _descendants(child.pid)
    tracked.extend(below)
    child.send_signal(signum)  # the child itself through Popen, which knows whether its pid is still its own
    for process in below:
        process.signal(signum)


def _descendants(pid: int) -> list[_Process]:
    """The processes below ``pid``, children first, on Linux (/proc); elsewhere none are known."""
    found: list[_Process] = []
    below = _children(pid)
    while below:
        child = below.pop(0)
        stat = _stat(child)
        if stat is not None:
            found.append(_Process(child, stat[2]))
            below.extend(_children(child))
    return found


def _children(pid: int) -> list[int]:
    """``pid``'s children: from each of its threads' ``children`` file where the kernel has them, else from
    every process's parent, read in /proc."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone, or no /proc
        return []
    try:
        return [int(c) for t in threads for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN (or a thread that just ended)
        pass
    except OSError:
        return []
    children = []
    for entry in os.listdir("/proc"):
        stat = _stat(int(entry)) if entry.isdigit() else None
        if stat is not None and stat[0] == pid:
            children.append(int(entry))
    return children


def _stat(pid: int) -> tuple[int, str, int] | None:
    """A process's parent, state and start time, from /proc/PID/stat; None if it is gone (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # "pid (comm) state ppid ... starttime (the 22nd)": comm may hold spaces and parentheses: split after its last ")"
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 20:
        return None
    return int(fields[1]), fields[0].decode(), int(fields[19])


def _command_environment(lease: permits.Lease) -> dict[str, str]:
    """COMMAND's environment: this process's, and its lease: the key, and the fencing tokens to hand the
    resources it writes. PERMITS_FENCING_TOKEN is there only for a lease of one semaphore; one inherited
    (an outer ``permits run``'s) is removed, or it would pass for this lease's."""
    tokens = {name: str(token) for name, token in lease.tokens.items()}
    environment = {k: v for k, v in os.environ.items() if k != "PERMITS_FENCING_TOKEN"}
    environment["PERMITS_LEASE_KEY"] = lease.key
    environment["PERMITS_FENCING_TOKENS"] = json.dumps(tokens, ensure_ascii=False)
    if len(tokens) == 1:
        environment["PERMITS_FENCING_TOKEN"] = next(iter(tokens.values()))
    return environment


def _die_with_this_process() -> Callable[[], None] | None:
    """What COMMAND's process runs before exec, on Linux: a SIGKILL for it the moment this process dies.

    Killed outright (SIGKILL, the OOM killer), ``permits run`` can neither keep the lease alive nor
    stop COMMAND, which would go on working unprotected once the lease expired. The kernel's
    parent-death signal ends it instead. It is tied to the thread that started COMMAND, the main thread,
    which lives as long as the process does. Elsewhere, COMMAND outlives a killed ``permits run``.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: after fork, only the call is made
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # this process died between the fork and the prctl
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def _in_the_terminals_foreground() -> bool:
    """Whether this process is in the foreground process group of its controlling terminal."""
    try:
        with open("/dev/tty", "rb", buffering=0) as tty:
            return os.tcgetpgrp(tty.fileno()) == os.getpgrp()
    except OSError:
        return False


# ------------------------------------------------------------------------------------------- service


def _server_module() -> Any:
    try:
        from permits.server import run as server_run
    except ImportError as exc:  # the server extra is not installed
        click.echo(f"permits: the service needs: pip install 'permits[server]' ({exc.name} is missing)", err=True)
        sys.exit(EXIT_USAGE)
    return server_run


def _server_config(config_file: Path | None, **overrides: Any) -> Any:
    from permits.server.config import ServerConfig

    try:
        return ServerConfig.load(config_file, **overrides)
    except PermitsError as exc:
        _fail(exc, EXIT_USAGE)


@main.command()
@click.option(
    "--db",
    "db",
    default=None,
    metavar="URL",
    callback=_db_given_first,
    help="Database URL (default: $PERMITS_DATABASE_URL, else sqlite:///permits.db).",
)
@click.option("--host", default=None, help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port (default 8080; 0 picks a free one).")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML settings file (see docs/service.md).",
)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True
)
def serve(
    db: str | None, host: str | None, port: int | None, config_file: Path | None, log_format: str, log_level: str
) -> None:
    """Run the HTTP service: stateless, any number of instances in front of one database."""
    server_run = _server_module()
    config = _server_config(config_file, database_url=db, host=host, port=port)
    try:
        server_run.serve(config, log_format=log_format, log_level=log_level)
    except PermitsError as exc:
        _fail(exc, EXIT_USAGE if isinstance(exc, InvalidArgument | ConfigurationError) else EXIT_FAILED)


@main.command()
@click.option(
    "--db",
    "db",
    default=None,
    metavar="URL",
    callback=_db_given_first,
    help="Database URL (default: $PERMITS_DATABASE_URL, else sqlite:///permits.db).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML settings file (see docs/service.md).",
)
@click.option(
    "--task",
    "tasks",
    multiple=True,
    type=click.Choice(["sweep", "liveness", "staleness", "cleanup"]),
    help="Run only these (default: every configured task).",
)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
def maintain(db: str | None, config_file: Path | None, tasks: tuple[str, ...], log_format: str) -> None:
    """Run the service's maintenance tasks once, for cron; each runs only if no instance runs it now."""
    server_run = _server_module()
    config = _server_config(config_file, database_url=db)
    try:
        results = server_run.run_maintain(config, tasks, log_format=log_format, level="info")
    except PermitsError as exc:
        _fail(exc, EXIT_FAILED)
    for name, outcome in results.items():
        click.echo(f"{name}: {outcome}")
    sys.exit(EXIT_FAILED if "failed" in results.values() else 0)


# --------------------------------------------------------------------------------------------- demo


@main.command()
@click.option(
    "--workers", type=click.IntRange(1, 64), default=6, show_default=True, help="Processes competing for permits."
)
@click.option("--capacity", type=click.IntRange(1), default=2, show_default=True)
@click.option(
    "--hold",
    type=float,
    default=0.6,
    show_default=True,
    help="Seconds each worker holds a permit.",
    callback=lambda _ctx, _param, value: _seconds(value),
)
@click.option("--rounds", type=click.IntRange(1), default=2, show_default=True, help="Turns each worker takes.")
@_db_option
def demo(workers: int, capacity: int, hold: float, rounds: int, db: str | None) -> None:
    """A live demo: several processes share one semaphore through `permits run`; capacity holds."""
    from permits._demo import run_demo

    try:
        ok = run_demo(db, workers=workers, capacity=capacity, hold=hold, rounds=rounds)
    except PermitsError as exc:
        _fail(exc, EXIT_FAILED)
    sys.exit(0 if ok else EXIT_FAILED)


if __name__ == "__main__":  # pragma: no cover
    main(prog_name=os.path.basename(sys.argv[0]))
