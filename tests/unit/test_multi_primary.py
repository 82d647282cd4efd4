"""Which statements a MariaDB or MySQL server gets: one request per statement on a multi-primary cluster.

On a Galera node the one-request grant batch was found half-committed after an abort (dialects/mysql.py);
tests/scaleout/test_galera.py shows the cluster statements on a real cluster, and
tests/scaleout/test_cluster_statements.py runs them on the plain MariaDB server.
"""

from __future__ import annotations

import pytest

from permits.dialects.mysql import (
    MariaDB,
    MariaDB105,
    MariaDBCluster,
    MariaDBWithoutLine,
    MySQL,
    MySQLCluster,
    is_multi_primary,
    logs_statements,
    mysql_family_dialect,
    rolls_back_on_timeout,
)


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ([], False),  # plain MariaDB or MySQL: neither variable exists
        ([("wsrep_on", "OFF")], False),  # a MariaDB build with Galera, not in a cluster
        ([("wsrep_on", "ON")], True),  # a Galera node
        ([("WSREP_ON", "on")], True),
        ([("group_replication_group_name", "")], True),  # the Group Replication plugin is loaded
        ([("wsrep_on", "OFF"), ("group_replication_group_name", "aaaa")], True),
    ],
)
def test_multi_primary_is_told_from_the_server_variables(variables: list[tuple[str, str]], expected: bool) -> None:
    assert is_multi_primary(variables) is expected


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ([], False),
        ([("log_bin", "OFF"), ("binlog_format", "STATEMENT")], False),  # the format of a log nobody writes
        ([("log_bin", "ON"), ("binlog_format", "MIXED")], False),  # READ COMMITTED writes are logged as rows
        ([("log_bin", "ON"), ("binlog_format", "ROW")], False),
        ([("log_bin", "ON"), ("binlog_format", "STATEMENT")], True),
        ([("LOG_BIN", "1"), ("BINLOG_FORMAT", "statement")], True),
    ],
)
def test_a_binary_log_of_statements_is_told_from_the_server_variables(
    variables: list[tuple[str, str]], expected: bool
) -> None:
    """There InnoDB refuses writes under READ COMMITTED (1665), as MariaDB's line makes them."""
    assert logs_statements(variables) is expected


@pytest.mark.parametrize(
    ("variables", "expected"),
    [([], False), ([("innodb_rollback_on_timeout", "OFF")], False), ([("INNODB_ROLLBACK_ON_TIMEOUT", "on")], True)],
)
def test_a_rollback_of_the_whole_transaction_on_a_lock_wait_timeout_is_told_from_the_server_variables(
    variables: list[tuple[str, str]], expected: bool
) -> None:
    """There the head of the line, whose try at a busy row is a lock wait timeout, would lose the line."""
    assert rolls_back_on_timeout(variables) is expected


def test_each_server_gets_its_dialect() -> None:
    assert type(mysql_family_dialect(is_mariadb=True, multi_primary=False)) is MariaDB
    assert type(mysql_family_dialect(is_mariadb=True, multi_primary=False, version=(10, 11, 19))) is MariaDB
    assert type(mysql_family_dialect(is_mariadb=True, multi_primary=False, version=(10, 6, 0))) is MariaDB
    # Before JSON_TABLE: a grant over several semaphores a statement at a time.
    assert type(mysql_family_dialect(is_mariadb=True, multi_primary=False, version=(10, 5, 27))) is MariaDB105
    assert MariaDB().has("ACQUIRE_MANY") and not MariaDB105().has("ACQUIRE_MANY")
    assert MariaDB105().has("ACQUIRE_ONE")
    assert not MySQL().has("ACQUIRE_MANY")
    assert type(mysql_family_dialect(is_mariadb=False, multi_primary=False)) is MySQL
    assert type(mysql_family_dialect(is_mariadb=True, multi_primary=True)) is MariaDBCluster
    # A binary log of statements, or a rollback of the whole transaction on a lock wait timeout: no line
    # (tests/concurrency/test_mariadb_line.py runs both).
    assert type(mysql_family_dialect(is_mariadb=True, multi_primary=False, no_line=True)) is MariaDBWithoutLine
    assert MariaDBWithoutLine().has("ACQUIRE_ONE") and not MariaDBWithoutLine().has("LINE_WAIT")
    assert type(mysql_family_dialect(is_mariadb=False, multi_primary=True)) is MySQLCluster


@pytest.mark.parametrize("dialect", [MariaDBCluster(), MySQLCluster()], ids=type)
def test_cluster_dialects_send_no_batches(dialect: MariaDB) -> None:
    assert not dialect.self_committing
    assert not dialect.has("ACQUIRE_ONE")
    assert not dialect.has("ACQUIRE_MANY")
    for name in dialect._sql:  # every statement it has, not only the hot ones
        sql = dialect.sql(name)
        assert ";" not in sql and "COMMIT" not in sql.upper(), name


def test_release_is_the_batch_without_its_commit() -> None:
    batch, alone = MariaDB().sql("RELEASE"), MariaDBCluster().sql("RELEASE")
    assert batch.rstrip().endswith("COMMIT")
    assert batch.startswith(alone.rstrip())
