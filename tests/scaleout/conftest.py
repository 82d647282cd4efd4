"""One 3-node Galera cluster for the whole session (test_galera.py and test_galera_faults.py): starting one
takes 10-15 s on two cores. Each module gets it with all three nodes running and Synced, whatever an
earlier test (one that kills a node and failed before it was back) left."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._galera import GaleraCluster


@pytest.fixture(scope="session")
def galera_cluster() -> Iterator[GaleraCluster]:
    with GaleraCluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def galera(galera_cluster: GaleraCluster) -> GaleraCluster:
    for i, node in enumerate(galera_cluster.nodes):
        if not node.running:
            galera_cluster.restart(i)
    for i in range(len(galera_cluster.nodes)):
        galera_cluster.wait_synced(i, size=len(galera_cluster.nodes))
    return galera_cluster
