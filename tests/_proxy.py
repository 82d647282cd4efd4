"""A tiny TCP proxy that cuts connections on cue, for the connection-loss tests.

    with CuttingProxy(("127.0.0.1", 5432)) as proxy:       # listens on 127.0.0.1:<proxy.port>
        proxy.cut_after_server_bytes(40)                   # the next 40 bytes from the server get through,
        ...                                                #   then the connection carrying them is cut
        proxy.cut_after_client_packets(3, every=True)      # every connection, after its client's 3rd packet
        proxy.heal()                                       # stop cutting
        proxy.stall()                                      # hold every byte, both ways, on every connection
        proxy.resume()                                     #   (new ones too) until resumed: a stalled link
        proxy.stall(new_too=False)                         # only the connections open now stall: one path
                                                           #   through a load balancer hangs, new ones work
        proxy.stall_on(b"SELECT pid")                      # a connection stalls when its client sends this
        proxy.down()                                       # cut every connection, and drop each new one at
        proxy.up()                                         #   once, until up: the server is down


A stall is a link that stops carrying anything without failing: no byte is lost, none is delivered, and
neither end sees an error until the stall ends (or ``cut_all()`` cuts the stalled connections).

A cut shuts both sockets down (the client sees the connection drop, the server sees the client go away),
like a network failure or a proxy restart between the two. Loopback only; two threads per connection.

Rules count either from the moment they are armed, across all connections, and fire once (the default:
the client under test runs one connection at a time, so "the next N bytes" is a point in its exchange),
or, with ``every=True``, from the start of each connection, for every connection until ``heal()``.
A "packet" is what one ``recv`` on the client's socket returned: the drivers send each request in one
write, which arrives whole on loopback.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass
from types import TracebackType

from sqlalchemy.engine import make_url


@dataclass
class _Rule:
    kind: str  # "server_bytes" or "client_packets"
    limit: int
    every: bool
    used: int = 0  # one-shot rules: bytes or packets let through since the rule was armed


class _Link:
    """One proxied connection: the client's socket and ours to the server."""

    def __init__(self, proxy: CuttingProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = server
        self.server_bytes = 0
        self.client_packets = 0
        self.cut = False
        #: cleared while this link is stalled
        self.flowing = threading.Event()
        self._pumps_left = 2

    def start(self) -> None:
        for src, dst, upstream in ((self.client, self.server, True), (self.server, self.client, False)):
            threading.Thread(target=self._pump, args=(src, dst, upstream), daemon=True).start()

    def shut(self) -> None:
        """Cut both ways now. The sockets are closed by the last pump to stop, so that no file descriptor
        is closed while the other thread may still use it."""
        self.cut = True
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while True:
                try:
                    data = src.recv(65536)
                except OSError:
                    break
                if not data:
                    break
                marker = self.proxy._stall_marker
                if upstream and marker is not None and marker in data:
                    self.flowing.clear()
                while not self.flowing.wait(0.05):  # stalled: hold the data until resumed or cut
                    if self.cut:
                        break
                if self.cut:
                    break
                forward, cut = self.proxy._decide(self, data, upstream)
                if forward:
                    try:
                        dst.sendall(forward)
                    except OSError:
                        break
                if cut:
                    break
        finally:
            self.shut()
            with self.proxy._lock:
                self._pumps_left -= 1
                last = self._pumps_left == 0
                if last:
                    self.proxy._links.discard(self)
            if last:
                self.client.close()
                self.server.close()


class CuttingProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._lock = threading.Lock()
        self._rule: _Rule | None = None
        self._links: set[_Link] = set()
        self._closed = False
        self._stall_new = False  # new connections start stalled
        self._stall_marker: bytes | None = None  # a connection whose client sends this stalls
        self._down = False  # new connections are dropped at once
        #: bytes sent by the server and forwarded to clients, over all connections
        self.server_bytes = 0
        #: packets (recv results) sent by clients and forwarded to the server, over all connections
        self.client_packets = 0
        #: connections accepted, and connections cut by a rule
        self.connections = 0
        #: connections dropped at once while down
        self.dropped = 0
        self.cuts = 0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    @classmethod
    def before(cls, db_url: str) -> CuttingProxy:
        """A proxy in front of the server of a database URL (a context manager, as the class is)."""
        url = make_url(db_url)
        assert url.host is not None and url.port is not None
        return cls((url.host, url.port))

    def url_for(self, db_url: str) -> str:
        """``db_url`` through this proxy."""
        return make_url(db_url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    # ---- control

    def cut_after_server_bytes(self, n: int, *, every: bool = False) -> None:
        """Let ``n`` more bytes from the server through, then cut the connection that carries the next one."""
        with self._lock:
            self._rule = _Rule("server_bytes", n, every)

    def cut_after_client_packets(self, n: int, *, every: bool = False) -> None:
        """Forward ``n`` more client packets (n >= 1) to the server, then cut the connection of the last."""
        if n < 1:
            raise ValueError("n must be at least 1")
        with self._lock:
            self._rule = _Rule("client_packets", n, every)

    def heal(self) -> None:
        """Stop cutting."""
        with self._lock:
            self._rule = None

    def stall(self, *, new_too: bool = True) -> None:
        """Stop carrying data, both ways, on every open connection, without cutting any; with ``new_too``,
        on every connection made from now on as well."""
        with self._lock:
            self._stall_new = new_too
            for link in self._links:
                link.flowing.clear()

    def stall_on(self, marker: bytes) -> None:
        """Stall each connection, from the client packet that holds ``marker`` on (that packet included),
        until resumed: a link that hangs at a chosen point of the exchange."""
        self._stall_marker = marker

    def resume(self) -> None:
        """Carry data again; what was held during the stall is delivered now."""
        with self._lock:
            self._stall_marker = None
            self._stall_new = False
            for link in self._links:
                link.flowing.set()

    def cut_all(self) -> None:
        """Cut every open connection now."""
        with self._lock:
            links = list(self._links)
        for link in links:
            link.shut()

    def down(self) -> None:
        """Cut every open connection, and drop every new one as soon as it is accepted, until ``up()``: to
        the client, the server is down (restarting, failing over)."""
        self._down = True
        self.cut_all()

    def up(self) -> None:
        """Carry new connections again."""
        self._down = False

    def close(self) -> None:
        self._closed = True
        self.resume()
        self._acceptor.join()
        self._listener.close()
        self.cut_all()

    def __enter__(self) -> CuttingProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- machinery

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._down:
                client.close()
                self.dropped += 1
                continue
            client.settimeout(None)
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(self, client, server)
            with self._lock:
                if not self._stall_new:
                    link.flowing.set()
                self.connections += 1
                self._links.add(link)
            link.start()

    def _decide(self, link: _Link, data: bytes, upstream: bool) -> tuple[bytes, bool]:
        """What part of ``data`` to forward, and whether to cut the link after it."""
        with self._lock:
            if link.cut:
                return b"", False
            rule = self._rule
            if upstream:
                link.client_packets += 1
                if rule is not None and rule.kind == "client_packets":
                    seen = link.client_packets if rule.every else rule.used + 1
                    rule.used += 1
                    if seen >= rule.limit:
                        self._fired(rule)
                        self.client_packets += 1
                        return data, True
                self.client_packets += 1
                return data, False
            if rule is not None and rule.kind == "server_bytes":
                before = link.server_bytes if rule.every else rule.used
                room = max(0, rule.limit - before)
                if len(data) > room:
                    self._fired(rule)
                    link.server_bytes += room
                    self.server_bytes += room
                    return data[:room], True
                rule.used += len(data)
            link.server_bytes += len(data)
            self.server_bytes += len(data)
            return data, False

    def _fired(self, rule: _Rule) -> None:
        self.cuts += 1
        if not rule.every:
            self._rule = None
