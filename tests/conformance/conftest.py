"""The behaviour suite runs twice on every backend: against the database directly, and through a real
``permits serve`` process in front of the same database (open mode: owners are stored as given, so the
two must behave the same to the letter)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import permits
from tests._service import Service
from tests.conftest import AsyncFacade


@pytest.fixture(scope="session")
def services() -> Iterator[dict[str, Service]]:
    running: dict[str, Service] = {}
    yield running
    for service in running.values():
        service.stop()


@pytest.fixture(params=["db", "service"])
def via(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def client_url(via: str, db_url: str, services: dict[str, Service]) -> str:
    if via == "db":
        return db_url
    if db_url not in services:
        # No background sweeps: the suite checks how each lease ended, and a sweep racing it would
        # change "expired" into "swept". Maintenance has tests of its own.
        services[db_url] = Service(db_url, env={"PERMITS_MAINTENANCE__ENABLED": "false"})
    return services[db_url].url


@pytest.fixture
def make_client(client_url: str, flavour: str) -> Iterator[Callable[..., Any]]:
    opened: list[Any] = []

    def make(**options: Any) -> Any:
        client: Any
        if flavour == "sync":
            client = permits.connect(client_url, **options)
        else:
            client = AsyncFacade(permits.connect_async(client_url, **options))
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.shutdown() if isinstance(client, AsyncFacade) else client.close()
