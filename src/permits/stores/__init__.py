"""Stores carry out operations against one kind of storage; ``base`` says what every store must do.

A store is picked by the URL's scheme. The SQL stores (``permits._async.store`` and its generated twin)
serve sqlite, mysql/mariadb and postgresql; the HTTP stores (``permits._async.http_store``) serve http and
https, through a permits service. Another store registers its scheme with ``register_store`` and must pass
the same behaviour suite (tests/conformance).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from permits._config import Settings
from permits.stores.base import AsyncStore, Store

_SYNC: dict[str, Callable[[Settings], Store]] = {}
_ASYNC: dict[str, Callable[[Settings], AsyncStore]] = {}


def register_store(
    scheme: str, sync_factory: Callable[[Settings], Store], async_factory: Callable[[Settings], AsyncStore]
) -> None:
    """Serve URLs of ``scheme`` (``redis://...``) with another store."""
    _SYNC[scheme] = sync_factory
    _ASYNC[scheme] = async_factory


_HTTP_SCHEMES = ("http", "https")


def sync_store_for(settings: Settings) -> Store:
    scheme = settings.url.get_backend_name()
    factory = _SYNC.get(scheme)
    if factory is not None:
        return factory(settings)
    if scheme in _HTTP_SCHEMES:
        from permits._sync.http_store import HTTPStore

        return HTTPStore(settings)
    from permits._sync.store import SQLStore

    return SQLStore(settings)


def async_store_for(settings: Settings) -> AsyncStore:
    scheme = settings.url.get_backend_name()
    factory = _ASYNC.get(scheme)
    if factory is not None:
        return factory(settings)
    if scheme in _HTTP_SCHEMES:
        from permits._async.http_store import AsyncHTTPStore

        return AsyncHTTPStore(settings)
    store: AsyncStore = async_sql_store(settings)
    return store


def async_sql_store(settings: Settings) -> Any:
    """The asyncio SQL store for a database URL. SQLite's runs each operation on a worker thread over
    the sync store (see ``permits.stores.threaded``); the servers' use their native async drivers."""
    if settings.url.get_backend_name() == "sqlite":
        from permits.stores.threaded import ThreadedSQLStore

        return ThreadedSQLStore(settings)
    from permits._async.store import AsyncSQLStore

    return AsyncSQLStore(settings)
