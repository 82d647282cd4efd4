"""Debian's Chromium, driven by Playwright, for the tests of the pages the service draws in a browser
(Playwright's own browser download does not work everywhere; scripts/test installs chromium). The modules
that drive it import Playwright themselves (``pytest.importorskip``), so that without it only they skip."""

from __future__ import annotations

import os

import pytest

CHROMIUM = "/usr/bin/chromium"

#: For each such test module: in CI a missing browser is a failure, not a skip.
needs_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM) and os.environ.get("CI") != "true",
    reason="no /usr/bin/chromium: scripts/test installs it (apt-get install chromium)",
)
