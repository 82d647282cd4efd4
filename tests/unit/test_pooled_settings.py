"""Behind a transaction pooler, the settings permits cannot make itself, and the statements that would make
them on the server (``PostgreSQL.pooled_settings_fixes``, from a row of ``SESSION_TIMEOUTS``)."""

from __future__ import annotations

from permits.dialects.postgresql import PostgreSQL


def test_each_missing_setting_gets_its_statement_for_the_role() -> None:
    fixes = PostgreSQL().pooled_settings_fixes(("0", "0", "0", '"first.last"'), lock_wait_timeout=5)
    assert [(f.name, f.value) for f in fixes] == [
        ("lock_timeout", "5000ms"),
        ("idle_in_transaction_session_timeout", "30000ms"),
        ("client_connection_check_interval", "1000ms"),
    ]
    assert [f.statement for f in fixes] == [
        "ALTER ROLE \"first.last\" SET lock_timeout = '5000ms';",
        "ALTER ROLE \"first.last\" SET idle_in_transaction_session_timeout = '30000ms';",
        "ALTER ROLE \"first.last\" SET client_connection_check_interval = '1000ms';",
    ]


def test_settings_in_force_and_a_setting_the_server_does_not_have_need_nothing() -> None:
    # Before PostgreSQL 14 there is no client_connection_check_interval: current_setting(name, true) is NULL.
    assert PostgreSQL().pooled_settings_fixes(("300ms", "30s", None, "permits"), lock_wait_timeout=5) == []
    assert PostgreSQL().pooled_settings_fixes(("300ms", "30s", "1s", "permits"), lock_wait_timeout=5) == []
