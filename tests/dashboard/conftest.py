from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.dashboard._browser import CHROMIUM


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium for the module's tests (tests.dashboard._browser)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        chromium.close()
