"""`permits db drop-old-functions`: the server functions of other versions of permits go, this version's
and everyone else's stay (docs/deployment.md, "Server functions")."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

import permits
from tests._proxy import CuttingProxy
from tests.cli.test_cli import _permits
from tests.conftest import own_database, sqlalchemy_url, temporary_role

#: Functions named as another version of permits names its own (other hashes), in the search_path's schema.
OLD = [
    "permits_release_00000000deadbeef(arg_owner text, arg_key text)",
    "permits_acquire_one_queued_0123456789abcdef(arg_name text)",
]
#: Functions that must stay: not named as permits names its functions, or in a schema off the search_path.
OTHERS = [
    "permits_release_by_hand(arg_owner text)",
    "elsewhere.permits_release_00000000deadbeef(arg_owner text, arg_key text)",
]
#: And a procedure named as permits names its functions: not one of them (DROP FUNCTION would refuse it).
PROCEDURE = "permits_release_1111111111111111(arg_owner text)"


def _functions(url: str) -> set[str]:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT n.nspname || '.' || p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                    " WHERE p.proname LIKE 'permits%'"
                )
            )
            return {str(row[0]) for row in rows}
    finally:
        engine.dispose()


def _create(url: str, signatures: list[str], procedures: tuple[str, ...] = ()) -> None:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.begin() as conn:
            if any(s.startswith("elsewhere.") for s in signatures):
                conn.execute(text("CREATE SCHEMA IF NOT EXISTS elsewhere"))
            for signature in signatures:
                conn.execute(text(f"CREATE FUNCTION {signature} RETURNS integer LANGUAGE sql AS $$ SELECT 1 $$"))
            for signature in procedures:
                conn.execute(text(f"CREATE PROCEDURE {signature} LANGUAGE sql AS $$ SELECT 1 $$"))
    finally:
        engine.dispose()


def test_only_the_functions_of_other_versions_are_dropped() -> None:
    with own_database("postgresql", "permits_oldfn") as url:
        pooled = f"{url}?pooler=transaction"
        _permits(pooled, "db", "upgrade")  # this version's six: two queued grants, two grants, two releases
        current = {name for name in _functions(url) if name.startswith("public.")}
        assert len(current) == 6, current
        _create(url, OLD + OTHERS, (PROCEDURE,))
        before = _functions(url)

        listed = _permits(pooled, "db", "drop-old-functions", "--dry-run").stdout.splitlines()
        assert sorted(listed) == sorted(f"would drop public.{signature}" for signature in OLD), listed
        assert _functions(url) == before, "a dry run drops nothing"

        dropped = _permits(pooled, "db", "drop-old-functions").stdout.splitlines()
        assert sorted(dropped) == sorted(f"dropped public.{signature}" for signature in OLD), dropped
        assert _functions(url) == before - {f"public.{signature.split('(')[0]}" for signature in OLD}
        assert current <= _functions(url)
        again = _permits(pooled, "db", "drop-old-functions").stdout.strip()
        assert again == "no server functions of other versions of permits"

        # This version's clients go on calling their own.
        with permits.connect(pooled) as client:
            client.create_semaphore("after", 1)
            with client.lease("after", timeout=5) as lease:
                assert lease.tokens == {"after": 1}


def test_runs_at_the_same_time_all_succeed_and_drop_each_function_once() -> None:
    """Four runs at once, as when several hosts run it from a deploy script. Each lists the same functions
    and drops them in one transaction, in name order, so none waits for another in a cycle. The test holds
    a lock on the first old function until all four are waiting for it: the first to go on drops them,
    and the others find them gone (DROP FUNCTION IF EXISTS) and exit 0 as well."""
    old = [f"permits_release_{i:016x}(arg_owner text, arg_key text)" for i in range(12)]
    with own_database("postgresql", "permits_oldfn") as url:
        _permits(url, "db", "upgrade")
        current = _functions(url)
        _create(url, old)
        env = {**os.environ, "PERMITS_DATABASE_URL": url, "PERMITS_OWNER": "cli-tests"}
        engine = create_engine(sqlalchemy_url(url))
        try:
            with engine.connect() as holder:
                holder.execute(text(f"COMMENT ON FUNCTION {old[0]} IS 'held by the test'"))  # locks it
                runs = [
                    subprocess.Popen(
                        [sys.executable, "-m", "permits", "db", "drop-old-functions"],
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                    for _ in range(4)
                ]
                with engine.connect() as watcher:
                    waiting = (
                        "SELECT count(*) FROM pg_locks WHERE NOT granted"
                        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                    )
                    deadline = time.monotonic() + 60
                    while watcher.execute(text(waiting)).scalar_one() < 4:
                        assert time.monotonic() < deadline, "the four runs never all waited for the lock"
                        assert all(run.poll() is None for run in runs), [run.communicate() for run in runs]
                        time.sleep(0.1)
                        watcher.rollback()
                holder.rollback()  # let them go
            outputs = [run.communicate(timeout=60) for run in runs]
        finally:
            engine.dispose()
        assert [run.returncode for run in runs] == [0] * 4, outputs
        assert _functions(url) == current
        for stdout, _ in outputs:  # each run reports what it found and dropped or found gone
            assert sorted(stdout.splitlines()) == sorted(f"dropped public.{signature}" for signature in old)


def test_a_role_drops_only_the_old_functions_whose_owners_privileges_it_has() -> None:
    """Run as a role that is no superuser: an old function it owns goes; one owned by another role, which it
    could not drop, is not even listed, so the rest are dropped rather than the whole command failing."""
    with own_database("postgresql", "permits_oldfn") as url:
        _permits(url, "db", "upgrade")
        grants = [
            "GRANT CREATE, USAGE ON SCHEMA public TO {role}",
            "GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}",
        ]
        with temporary_role(url, "permits_dropper", grants) as role_url:
            theirs, mine = OLD
            _create(url, [theirs])  # owned by the superuser
            _create(role_url, [mine])
            dropped = _permits(role_url, "db", "drop-old-functions").stdout.splitlines()
            assert dropped == [f"dropped public.{mine}"], dropped
            assert f"public.{theirs.split('(')[0]}" in _functions(url)


@pytest.mark.parametrize("backend", ["sqlite", "mysql"])
def test_databases_without_server_functions_have_none_to_drop(backend: str, tmp_path: Path) -> None:
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'permits.db'}"
        _permits(url, "db", "upgrade")
        assert _permits(url, "db", "drop-old-functions").stdout.strip() == (
            "no server functions of other versions of permits"
        )
        return
    with own_database(backend, "permits_oldfn") as url:
        _permits(url, "db", "upgrade")
        done = _permits(url, "db", "drop-old-functions")
        assert done.stdout.strip() == "no server functions of other versions of permits"


def test_a_client_of_the_service_is_told_where_to_run_it() -> None:
    client = permits.connect("http://127.0.0.1:9/")
    try:
        with pytest.raises(permits.UsageError, match="drop-old-functions --db"):
            client.drop_old_functions()
    finally:
        client.close()


def test_a_run_whose_connection_drops_still_names_what_it_dropped() -> None:
    """Cut after any of its requests (the reply to the COMMIT that dropped them among them), the run is
    retried and still answers with every function dropped: a retry that finds them gone already does not
    turn the answer into "none"."""
    with own_database("postgresql", "permits_oldfn") as url:
        _permits(url, "db", "upgrade")
        parsed = make_url(url)
        assert parsed.host is not None and parsed.port is not None
        expected = sorted(f"public.{signature}" for signature in OLD)
        with CuttingProxy((parsed.host, parsed.port)) as proxy:
            via = parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
            with permits.connect(via) as client:
                _create(url, OLD)
                assert sorted(client.drop_old_functions()) == expected  # opens the client, then drops
                _create(url, OLD)
                packets0 = proxy.client_packets
                assert sorted(client.drop_old_functions()) == expected
                packets = proxy.client_packets - packets0
                for m in range(1, packets + 1):
                    _create(url, OLD)
                    proxy.cut_after_client_packets(m)
                    try:
                        dropped = client.drop_old_functions()
                    except permits.StorageUnavailable:  # the store gave up: the caller runs it again
                        proxy.heal()
                        dropped = client.drop_old_functions()
                    proxy.heal()
                    assert sorted(dropped) == expected, f"cut after packet {m} of {packets}: {dropped}"
                    assert not {f"public.{s.split('(')[0]}" for s in OLD} & _functions(url)
