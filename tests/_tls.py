"""TLS in front of a real ``permits serve``, as a load balancer or a reverse proxy would put it (the service
itself speaks plain HTTP: docs/deployment.md), with a private CA made for the test by trustme.

    ca = trustme.CA()
    with TLSFront(("127.0.0.1", service_port), ca.issue_cert("127.0.0.1")) as front:
        ...                                                 # https://127.0.0.1:<front.port>; the client
                                                            # trusts it with SSL_CERT_FILE at ca.cert_pem

Loopback only; two threads per connection, as tests/_proxy.py's.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from types import TracebackType

import trustme


class TLSFront:
    """Accepts TLS with ``certificate`` and forwards the plain bytes to ``upstream``."""

    def __init__(self, upstream: tuple[str, int], certificate: trustme.LeafCert) -> None:
        self._target = upstream
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        certificate.configure_cert(self._context)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, host: str = "127.0.0.1") -> str:
        return f"https://{host}:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            client = self._context.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):  # the client refused our certificate: what some tests are about
            raw.close()
            return
        server = socket.create_connection(self._target)
        with self._lock:
            self._sockets |= {client, server}
        threading.Thread(target=self._pump, args=(server, client), daemon=True).start()
        self._pump(client, server)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for end in self._sockets:
                with contextlib.suppress(OSError):
                    end.close()

    def __enter__(self) -> TLSFront:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
