"""Running the service (``permits serve``) and one pass of maintenance (``permits maintain``)."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import sys
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from permits.server.app import JSONLogFormatter, create_app
from permits.server.config import ServerConfig, is_loopback
from permits.server.maintenance import Maintainer
from permits.server.state import ServiceState


def configure_logging(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JSONLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Alembic narrates every migration context at INFO; what ran is enough, at WARNING and above.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))


class _Server(uvicorn.Server):
    """uvicorn, plus: print where we listen once we do, and answer waiters as soon as a stop is asked."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, open_mode: bool) -> None:
        super().__init__(config)
        self._app = app
        self._open_mode = open_mode
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                shown = f"[{host}]" if ":" in host else host
                mode = " (open mode: no tokens configured, so listening on loopback only)" if self._open_mode else ""
                print(f"permits serving on http://{shown}:{port}{mode}; API docs at /docs", flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # In-flight requests finish (uvicorn waits up to shutdown_grace); requests waiting for room are
        # answered at once with a retryable 503, so their clients retry on another instance; live event
        # streams end (a dashboard reconnects to another instance from its cursor).
        state: ServiceState = self._app.state.permits
        if self._loop is not None:
            self._loop.call_soon_threadsafe(state.waker.draining.set)
            self._loop.call_soon_threadsafe(state.broadcaster.end_streams)
        super().handle_exit(sig, frame)


def serve(config: ServerConfig, log_format: str = "text", log_level: str = "info") -> None:
    config.check_bind()
    configure_logging(log_format, log_level)
    # Fail before listening, with the library's own message, if the database cannot be used: unreachable,
    # or its schema missing or out of date (the embedded default creates it). A supervisor restarts us.
    asyncio.run(_check_database(config))
    app = create_app(config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        access_log=False,  # the app logs each request itself, with its identity and timing
        timeout_graceful_shutdown=math.ceil(config.shutdown_grace),
        server_header=False,
        proxy_headers=not is_loopback(config.host),
    )
    _Server(uv_config, app, config.open_mode).run()


async def _check_database(config: ServerConfig) -> None:
    async with ServiceState.build(config).client as client:
        await client.ping()


async def maintain_once(config: ServerConfig, only: tuple[str, ...]) -> dict[str, str]:
    """Run each maintenance task once (those named in ``only``, or all that are configured)."""
    state = ServiceState.build(config)
    results: dict[str, str] = {}
    async with state.client:
        maintainer = Maintainer(state)
        for task in maintainer.tasks():
            if not only or task.name in only:
                results[task.name] = await maintainer.run_once(task)
    return results


def run_maintain(config: ServerConfig, only: tuple[str, ...], **logging_options: Any) -> dict[str, str]:
    configure_logging(**logging_options)
    return asyncio.run(maintain_once(config, only))
