"""What a client, a held lease and a watchdog show in a log line or a debugger: what they are, never a
password."""

from __future__ import annotations

from pathlib import Path

import permits


def test_reprs_name_the_database_the_owner_and_the_state(tmp_path: Path) -> None:
    client = permits.connect(f"sqlite:///{tmp_path / 'p.db'}", owner="repr-test")
    assert repr(client) == f"<Client 'sqlite:///{tmp_path / 'p.db'}' owner='repr-test'>"
    client.create_semaphore("backups", 2)
    held = client.lease({"backups": 2}, key="nightly", keepalive=True)
    assert repr(held) == "<Held backups:2 key='nightly' owner='repr-test' not held>"
    with held as lease:
        assert repr(held) == "<Held backups:2 key='nightly' owner='repr-test' held>"
        assert held.watchdog is not None
        assert repr(held.watchdog) == f"<Watchdog lease='nightly' ttl={lease.ttl:g} watching>"
    assert repr(held.watchdog) == f"<Watchdog lease='nightly' ttl={lease.ttl:g} stopped>"
    client.close()
    assert repr(client).endswith("owner='repr-test' closed>")


def test_a_clients_repr_hides_the_password() -> None:
    client = permits.connect("postgresql://app:s3cret@127.0.0.1:1/nothing")
    assert "s3cret" not in repr(client) and "***" in repr(client)
    client.close()
    remote = permits.connect_async("http://127.0.0.1:9", owner="o")
    assert repr(remote) == "<AsyncClient 'http://127.0.0.1:9' owner='o'>"


def test_leases_go_in_sets_and_survive_pickling(tmp_path: Path) -> None:
    """A lease is a value: it hashes by what names it (owner and key), so a caller can keep the leases it
    holds in a set or key a dict by them, and it pickles (a worker process hands it back to its parent)."""
    import pickle

    with permits.connect(f"sqlite:///{tmp_path / 'p.db'}", owner="o") as client:
        client.create_semaphore("s", 3)
        first, second = client.acquire("s", key="a"), client.acquire("s", key="b")
        copied = pickle.loads(pickle.dumps(first))
        assert copied == first and hash(copied) == hash(first)
        assert {first, second, copied} == {first, second}
        held = {first: "backup of a", second: "backup of b"}
        assert held[copied] == "backup of a"
        # A later read of the same lease is another state of it (its expires_in moved): not equal.
        assert client.get_lease("a").key == first.key
