"""The dashboard ships inside the wheel, small and self-contained: no build step, nothing fetched from
elsewhere at run time."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

from tests._service import ROOT

STATIC = ROOT / "src" / "permits" / "server" / "static"


def test_the_wheel_carries_the_page(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)]
    built = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("permits-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for asset in ("index.html", "dashboard.js", "dashboard.css", "icon.svg"):
        assert f"permits/server/static/{asset}" in names


def test_the_assets_are_small_and_load_nothing_from_elsewhere() -> None:
    sizes = {p.name: p.stat().st_size for p in STATIC.iterdir()}
    assert sum(sizes.values()) < 64_000, sizes
    for path in STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"(src|href)=\"https?://", text), path.name
        assert "innerHTML" not in text, path.name  # names and keys are user text: DOM APIs only
    page = (STATIC / "index.html").read_text()
    assert "<script>" not in page and "<style" not in page and " style=" not in page  # the CSP forbids them
