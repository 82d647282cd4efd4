"""Peer systems: other ways to share "at most N at once" between processes (interface: harness.py).

Each peer is used the way its documentation shows, with its non-blocking acquire: a cycle is one try and,
when granted, one release; a try that finds no room is a refusal (``cycle`` returns False), as for the
other systems. Capacity follows the scenario: ``hot`` is one semaphore of capacity 10 shared by every
client, ``spread`` one per client. Peers take one semaphore per acquire only.

Most peers are mutexes. For those, a semaphore of capacity N is N *slot* locks (``SlotClient``): a
client tries the slots one after the other, each with a non-blocking try, and takes the first that is
free. Each client starts at a different slot (client i at slot i mod N) so that clients do not all
queue on slot 0; a refusal therefore costs up to N round trips, which is the price of building a
semaphore out of mutexes.

``durable`` says whether a granted acquire has been written to disk (synced) before it returns, so that
it survives the store's crash and restart, as permits' grants do. Session locks held in a database
server's memory (advisory locks, GET_LOCK, and tooz's SQL drivers, which use them) and Redis are not.

The library imports live inside the classes: each client process imports only its own peer's library.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import Any

from harness import Scenario, backend_of, connect
from private_servers import ETCD, REDIS, ZOOKEEPER

# Expiry for the peers that have one, so a crashed holder's slot comes back: permits' benchmark client
# asks for the same lease (ttl=60, systems.py).
LEASE_SECONDS = 60
# Every key, lock name and znode of the peers starts with this, so setup can clear exactly ours.
NAMESPACE = "permits-bench"


def _only_semaphore(scenario: Scenario, client_index: int) -> str:
    names = scenario.semaphores_for(client_index)
    if len(names) != 1:
        raise ValueError("peers take one semaphore per acquire; run them with per_acquire=1")
    return names[0]


def slot_names(semaphore: str, capacity: int, client_index: int) -> list[str]:
    """The slot lock names of ``semaphore``, in the order client ``client_index`` tries them."""
    names = [f"{NAMESPACE}:{semaphore}:slot-{k}" for k in range(capacity)]
    start = client_index % capacity
    return names[start:] + names[:start]


class PeerSystem:
    """What every peer shares: its labels for the report and its checks before a run.

    ``store`` is where the state lives; ``backend`` the SQL backend the peer needs (None when it brings
    its own store and ignores the benchmark's backend URL).
    """

    name: str
    store: str
    durable: bool
    backend: str | None = None

    def setup(self, backend_url: str, scenario: Scenario) -> None:
        if self.backend is not None and backend_of(backend_url) != self.backend:
            raise ValueError(f"{self.name} runs on {self.backend} only, not on {backend_of(backend_url)}")
        if scenario.per_acquire != 1:
            raise ValueError(f"{self.name} takes one semaphore per acquire")
        self.clear(scenario)

    def clear(self, scenario: Scenario) -> None:
        """Remove what an earlier run left behind. Session locks need nothing: they end with the session."""

    client_class: type  # its constructor takes make_client's arguments

    def make_client(self, backend_url: str, scenario: Scenario, client_index: int) -> Any:
        return self.client_class(backend_url, scenario, client_index)


class SlotClient:
    """A capacity-N semaphore made of N slot locks, for the mutex-only peers (see the module docstring).

    A subclass opens its connection, then calls ``__init__`` which opens one lock object per slot with
    ``open_slot``. The default ``try_acquire`` is the spelling most lock libraries share,
    ``acquire(blocking=False)``.
    """

    def __init__(self, scenario: Scenario, client_index: int) -> None:
        semaphore = _only_semaphore(scenario, client_index)
        self._slots = [self.open_slot(name) for name in slot_names(semaphore, scenario.capacity, client_index)]

    def open_slot(self, name: str) -> Any:
        raise NotImplementedError

    def try_acquire(self, slot: Any) -> bool:
        return bool(slot.acquire(blocking=False))

    def release(self, slot: Any) -> None:
        slot.release()

    def cycle(self) -> bool:
        for slot in self._slots:
            if self.try_acquire(slot):
                self.release(slot)
                return True
        return False

    def close(self) -> None:
        """Close the connection the subclass opened."""


# --------------------------------------------------------------------------
# Session locks in the SQL servers, through the same drivers as the baselines
# --------------------------------------------------------------------------


class _SqlSlotClient(SlotClient):
    """Slots as named server-side session locks: one SELECT to try, one to unlock."""

    try_sql: str
    unlock_sql: str

    def __init__(self, backend_url: str, scenario: Scenario, client_index: int) -> None:
        self._conn = connect(backend_url)  # autocommit: the lock belongs to the session, not a transaction
        self._cur = self._conn.cursor()
        super().__init__(scenario, client_index)

    def try_acquire(self, slot: Any) -> bool:
        self._cur.execute(self.try_sql, (slot,))
        return bool(self._cur.fetchone()[0] == 1)

    def release(self, slot: Any) -> None:
        self._cur.execute(self.unlock_sql, (slot,))
        self._cur.fetchone()

    def close(self) -> None:
        self._conn.close()


class PgAdvisoryClient(_SqlSlotClient):
    try_sql = "SELECT pg_try_advisory_lock(%s)::int"
    unlock_sql = "SELECT pg_advisory_unlock(%s)"

    def open_slot(self, name: str) -> int:
        # Advisory locks are keyed by a bigint: the first 8 bytes of a hash of the slot's name.
        return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)


class PgAdvisorySystem(PeerSystem):
    """PostgreSQL session-level advisory locks: ``pg_try_advisory_lock`` / ``pg_advisory_unlock``.

    A mutex, so capacity N is N slot locks tried in a per-client rotated order (see ``SlotClient``).
    The lock lives in the server's shared memory, is never written to disk, and ends with the session.
    """

    name = "pg-advisory"
    client_class = PgAdvisoryClient
    store = "postgresql"
    backend = "postgresql"
    durable = False


class MariaDbGetLockClient(_SqlSlotClient):
    try_sql = "SELECT GET_LOCK(%s, 0)"  # timeout 0: answer at once, 1 = taken, 0 = held by another session
    unlock_sql = "SELECT RELEASE_LOCK(%s)"

    def open_slot(self, name: str) -> str:
        return name


class MariaDbGetLockSystem(PeerSystem):
    """MariaDB user-level locks: ``GET_LOCK(name, 0)`` / ``RELEASE_LOCK(name)``.

    A mutex, so capacity N is N slot locks tried in a per-client rotated order (see ``SlotClient``).
    The lock lives in the server's memory, is never written to disk, and ends with the session.
    """

    name = "mariadb-get-lock"
    client_class = MariaDbGetLockClient
    store = "mariadb"
    backend = "mariadb"
    durable = False


# --------------------------------------------------------------------------
# tooz
# --------------------------------------------------------------------------


class ToozClient(SlotClient):
    def __init__(self, backend_url: str, scenario: Scenario, client_index: int) -> None:
        from tooz import coordination

        # The driver is chosen by the URL's scheme: mysql:// or postgresql://, as the benchmark's URLs are.
        self._coordinator = coordination.get_coordinator(backend_url, f"bench-client-{client_index}".encode())
        self._coordinator.start()
        super().__init__(scenario, client_index)

    def open_slot(self, name: str) -> Any:
        return self._coordinator.get_lock(name.encode())

    def close(self) -> None:
        self._coordinator.stop()


class ToozSystem(PeerSystem):
    """tooz's coordinator with its SQL driver: ``get_lock(name)``, ``acquire(blocking=False)``, ``release()``.

    A mutex, so capacity N is N slot locks tried in a per-client rotated order (see ``SlotClient``).
    Underneath are the same session locks as ``pg-advisory`` (keyed by two bytes of an MD5 of the name)
    and ``mariadb-get-lock``, so they are not durable either; but tooz opens a new database connection
    for every try and closes it after the release or the refusal (its drivers do so to keep no lock
    state on a shared connection), on top of the coordinator's own connection.
    """

    durable = False
    client_class = ToozClient

    def __init__(self, backend: str) -> None:
        self.backend = self.store = backend
        self.name = f"tooz-{'mysql' if backend == 'mariadb' else backend}"


# --------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------


def _redis() -> Any:
    import redis

    return redis.Redis.from_url(f"redis://{os.environ[REDIS.env_var]}/0")


class RedisSystem(PeerSystem):
    """The Redis peers' common setup: delete our keys (Redis here is shared, so never FLUSHDB)."""

    store = "redis"
    durable = False  # acknowledged from memory; even with an append-only file, fsync is at most once a second

    def clear(self, scenario: Scenario) -> None:
        REDIS.ensure()
        client = _redis()
        try:
            keys = list(client.scan_iter(match=f"*{NAMESPACE}*", count=1000))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


class RedisPyLockClient(SlotClient):
    def __init__(self, backend_url: str, scenario: Scenario, client_index: int) -> None:
        self._redis = _redis()
        super().__init__(scenario, client_index)

    def open_slot(self, name: str) -> Any:
        # One Lock object per slot, reused: every acquire takes a fresh token.
        return self._redis.lock(name, timeout=LEASE_SECONDS)

    def close(self) -> None:
        self._redis.close()


class RedisPyLockSystem(RedisSystem):
    """redis-py's ``Lock`` (``SET NX PX`` to acquire, a Lua check-and-delete to release), ``blocking=False``.

    A mutex, so capacity N is N slot locks tried in a per-client rotated order (see ``SlotClient``).
    """

    name = "redis-py-lock"
    client_class = RedisPyLockClient


class PythonRedisLockClient(RedisPyLockClient):
    def open_slot(self, name: str) -> Any:
        import logging

        import redis_lock

        # It logs a WARNING for every refused non-blocking try: thousands a second here, and the
        # refusals are counted anyway.
        logging.getLogger("redis_lock.acquire").setLevel(logging.ERROR)

        return redis_lock.Lock(self._redis, name, expire=LEASE_SECONDS)


class PythonRedisLockSystem(RedisSystem):
    """python-redis-lock's ``redis_lock.Lock(conn, name, expire=60)``, ``acquire(blocking=False)``.

    A mutex, so capacity N is N slot locks tried in a per-client rotated order (see ``SlotClient``).
    Its release is a Lua script that also signals a list for blocked waiters.
    """

    name = "python-redis-lock"
    client_class = PythonRedisLockClient


# The common counting-semaphore pattern: a sorted set of holders scored by the time they acquired. One
# script drops the holders older than the TTL (crashed clients), then adds us if there is room. The
# time is the server's (TIME), so clients' clocks do not matter.
_ACQUIRE_SCRIPT = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - tonumber(ARGV[2]))
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
    redis.call('ZADD', KEYS[1], now_ms, ARGV[3])
    return 1
end
return 0
"""


class RedisLuaSemaphoreClient:
    def __init__(self, backend_url: str, scenario: Scenario, client_index: int) -> None:
        self._redis = _redis()
        self._key = f"{NAMESPACE}:{_only_semaphore(scenario, client_index)}"
        self._capacity = scenario.capacity
        # register_script sends EVALSHA (and loads the script once if the server does not have it).
        self._acquire = self._redis.register_script(_ACQUIRE_SCRIPT)
        self._holder = f"client-{client_index}-{uuid.uuid4().hex}"

    def cycle(self) -> bool:
        if not self._acquire(keys=[self._key], args=[self._capacity, LEASE_SECONDS * 1000, self._holder]):
            return False
        self._redis.zrem(self._key, self._holder)  # release: one ZREM, atomic on its own
        return True

    def close(self) -> None:
        self._redis.close()


class RedisLuaSemaphoreSystem(RedisSystem):
    """A counting semaphore in Redis: a sorted set of holders with TTL cleanup, acquired by one EVALSHA.

    A real semaphore: capacity N is one sorted set that admits N holders.
    """

    name = "redis-lua-semaphore"
    client_class = RedisLuaSemaphoreClient


# --------------------------------------------------------------------------
# ZooKeeper, through kazoo
# --------------------------------------------------------------------------

_ZNODE_ROOT = f"/{NAMESPACE}"


def _kazoo() -> Any:
    import logging

    from kazoo.client import KazooClient

    # kazoo logs "Connection dropped" at WARNING when a client stops its own connection: noise here.
    logging.getLogger("kazoo.client").setLevel(logging.ERROR)

    client = KazooClient(hosts=os.environ[ZOOKEEPER.env_var])
    client.start(timeout=30)
    return client


class KazooSystem(PeerSystem):
    """The ZooKeeper peers' common setup: a reachable server (private if need be), our znodes gone."""

    store = "zookeeper"
    durable = True  # every znode created is in the transaction log, synced, before the create returns

    def clear(self, scenario: Scenario) -> None:
        ZOOKEEPER.ensure()
        client = _kazoo()
        try:
            client.delete(_ZNODE_ROOT, recursive=True)
        finally:
            client.stop()
            client.close()


class KazooSemaphoreClient:
    def __init__(self, backend_url: str, scenario: Scenario, client_index: int) -> None:
        self._zk = _kazoo()
        path = f"{_ZNODE_ROOT}/{_only_semaphore(scenario, client_index)}"
        self._semaphore = self._zk.Semaphore(path, identifier=f"client-{client_index}", max_leases=scenario.capacity)

    def cycle(self) -> bool:
        if not self._semaphore.acquire(blocking=False):
            return False
        self._semaphore.release()
        return True

    def close(self) -> None:
        self._zk.stop()
        self._zk.close()


class KazooSemaphoreSystem(KazooSystem):
    """kazoo's ``Semaphore(path, max_leases=capacity)``, ``acquire(blocking=False)`` then ``release()``.

    A real semaphore. kazoo guards the lease count with a lock of its own, taken non-blocking too: a try
    that meets another client inside that lock is refused even when a lease is free.
    """

    name = "kazoo-semaphore"
    client_class = KazooSemaphoreClient


class KazooLockClient(SlotClient):
    def __init__(self, backend_url: str, scenario: Scenario, client_index: int) -> None:
        self._zk = _kazoo()
        self._identifier = f"client-{client_index}"
        super().__init__(scenario, client_index)

    def open_slot(self, name: str) -> Any:
        return self._zk.Lock(f"{_ZNODE_ROOT}/{name.replace(':', '/')}", self._identifier)

    def close(self) -> None:
        self._zk.stop()
        self._zk.close()


class KazooLockSystem(KazooSystem):
    """kazoo's ``Lock(path)``, ``acquire(blocking=False)`` then ``release()``.

    A mutex, so capacity N is N slot locks tried in a per-client rotated order (see ``SlotClient``).
    """

    name = "kazoo-lock"
    client_class = KazooLockClient


# --------------------------------------------------------------------------
# etcd, through its HTTP gateway (etcd3gw)
# --------------------------------------------------------------------------


def _etcd() -> Any:
    import etcd3gw

    host, _, port = os.environ[ETCD.env_var].rpartition(":")
    return etcd3gw.client(host=host, port=int(port))


class EtcdLockClient(SlotClient):
    def __init__(self, backend_url: str, scenario: Scenario, client_index: int) -> None:
        self._etcd = _etcd()
        super().__init__(scenario, client_index)

    def open_slot(self, name: str) -> Any:
        return self._etcd.lock(name, ttl=LEASE_SECONDS)

    def try_acquire(self, slot: Any) -> bool:
        return bool(slot.acquire())  # etcd3gw's acquire never waits: one compare-and-put

    def close(self) -> None:
        self._etcd.session.close()


class EtcdLockSystem(PeerSystem):
    """etcd3gw's ``Lock`` over etcd's v3 JSON gateway: ``client.lock(name, ttl=60)``, ``acquire()``, ``release()``.

    A mutex, so capacity N is N slot locks tried in a per-client rotated order (see ``SlotClient``).
    Each acquire grants a new lease (one request) and puts the key under it if the key is absent (a
    second); the release deletes the key if it is still ours. Both writes go through etcd's synced log.
    (The gRPC client, python-etcd3 0.12, does not import with the protobuf that pip installs today.)
    """

    name = "etcd3gw-lock"
    client_class = EtcdLockClient
    store = "etcd"
    durable = True

    def clear(self, scenario: Scenario) -> None:
        ETCD.ensure()
        from etcd3gw.utils import LOCK_PREFIX

        client = _etcd()
        try:
            client.delete_prefix(f"{LOCK_PREFIX}{NAMESPACE}:")
        finally:
            client.session.close()


PG_ADVISORY = PgAdvisorySystem()
MARIADB_GET_LOCK = MariaDbGetLockSystem()
TOOZ_POSTGRESQL = ToozSystem("postgresql")
TOOZ_MYSQL = ToozSystem("mariadb")
REDIS_PY_LOCK = RedisPyLockSystem()
REDIS_LUA_SEMAPHORE = RedisLuaSemaphoreSystem()
PYTHON_REDIS_LOCK = PythonRedisLockSystem()
KAZOO_SEMAPHORE = KazooSemaphoreSystem()
KAZOO_LOCK = KazooLockSystem()
ETCD3GW_LOCK = EtcdLockSystem()

# In the order the report lists them: the SQL servers' own locks first, then the other stores. Each is
# also this module's attribute of its name in capitals ("peers:REDIS_PY_LOCK"), as report.py names them.
PEERS: dict[str, PeerSystem] = {
    peer.name: peer
    for peer in (
        PG_ADVISORY,
        TOOZ_POSTGRESQL,
        MARIADB_GET_LOCK,
        TOOZ_MYSQL,
        REDIS_LUA_SEMAPHORE,
        REDIS_PY_LOCK,
        PYTHON_REDIS_LOCK,
        KAZOO_SEMAPHORE,
        KAZOO_LOCK,
        ETCD3GW_LOCK,
    )
}


def store_versions() -> str:
    """The versions of the peers' own stores, for the report's machine line (starting them if need be)."""
    REDIS.ensure()
    redis_client = _redis()
    zk = None
    try:
        redis_version = redis_client.info("server")["redis_version"]
        persistence = "append-only file" if redis_client.config_get("appendonly").get("appendonly") == "yes" else ""
        ZOOKEEPER.ensure()
        zk = _kazoo()
        # "srvr" is the one four-letter command a default server answers: "Zookeeper version: 3.8.0-..., built on"
        zk_version = zk.command(b"srvr").splitlines()[0].split(":", 1)[1].split("-", 1)[0].split(",")[0].strip()
        ETCD.ensure()
        etcd_version = _etcd().session.get(f"http://{os.environ[ETCD.env_var]}/version", timeout=5).json()
    finally:
        redis_client.close()
        if zk is not None:
            zk.stop()
            zk.close()
    return (
        f"Redis {redis_version} ({persistence or 'no append-only file'}), ZooKeeper {zk_version},"
        f" etcd {etcd_version['etcdserver']}"
    )


assert all(globals().get(name.upper().replace("-", "_")) is peer for name, peer in PEERS.items())
