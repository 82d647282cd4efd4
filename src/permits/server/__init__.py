"""The permits service: stateless HTTP instances in front of one database (``permits serve``).

Layout: ``config`` (settings and their bounds), ``auth`` (bearer tokens to identities), ``errors`` (error
codes to HTTP statuses), ``schemas`` (request and response bodies), ``prelock`` (the in-memory queue per
semaphore), ``routes`` (the /v1 API), ``maintenance`` (background jobs), ``metrics`` (Prometheus) and
``app`` (assembles them).
"""

from __future__ import annotations

from permits.server.app import create_app
from permits.server.config import ServerConfig, TokenEntry

__all__ = ["ServerConfig", "TokenEntry", "create_app"]
