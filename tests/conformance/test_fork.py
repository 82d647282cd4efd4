"""A client opened before ``fork()`` (a preforking server with its app loaded first, multiprocessing's
default start method on Linux): the children share the parent's sockets. Each child must use connections
of its own, and leave the parent's working: on MariaDB every process failed with "Packet sequence number
wrong", on PostgreSQL with replies to one another's statements, and grants were left held."""

from __future__ import annotations

import os

import permits

ROUNDS = 5
CHILDREN = 3


def test_children_forked_from_a_clients_process_use_connections_of_their_own(client_url: str, ns: str) -> None:
    name = f"{ns}s"
    with permits.connect(client_url, owner=f"{ns}o") as client:
        client.create_semaphore(name, 2)
        client.release(client.acquire(name, ttl=30))  # the parent's pool holds a connection now
        children = []
        for _ in range(CHILDREN):
            pid = os.fork()
            if pid == 0:  # the child: only what the inherited client does decides its status
                status = 1
                try:
                    tokens = []
                    for _ in range(ROUNDS):
                        lease = client.acquire(name, ttl=30, timeout=20)
                        tokens.append(lease.token)
                        client.release(lease)
                    status = 0 if tokens == sorted(set(tokens)) else 2
                except BaseException:  # reported by the status
                    import traceback

                    traceback.print_exc()
                finally:
                    os._exit(status)
            children.append(pid)
        # The parent goes on meanwhile, on its own connections.
        for _ in range(ROUNDS):
            client.release(client.acquire(name, ttl=30, timeout=20))
        statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
        assert statuses == [0] * CHILDREN
        client.release(client.acquire(name, ttl=30, timeout=20))  # and still works after they exit
        assert client.get_semaphore(name).used == 0
        assert [d for d in client.reconcile() if d.name == name] == []
