"""Fixtures of the fault tests, and the soak switch.

The soak test (marker ``soak``) runs only when ``PERMITS_SOAK`` is set to its duration in seconds:

    PERMITS_SOAK=1800 .venv/bin/python -m pytest tests/faults -m soak
"""

from __future__ import annotations

import os

import pytest

from tests._private_db import private_mariadb, private_postgresql

__all__ = ["private_mariadb", "private_postgresql"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PERMITS_SOAK"):
        return
    skip = pytest.mark.skip(reason="soak test: set PERMITS_SOAK=<seconds> to run it (e.g. 1800)")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)
