"""``PERMITS_WORKER_TRACE``'s report (tests/faults/worker.py): what grew after the base, and the peak."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from tests.faults import worker


@pytest.mark.beside_others  # no process, no server: it traces this one
def test_the_trace_names_what_grew_after_its_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker, "TRACE_BASE_SECONDS", 0.0)
    out = tmp_path / "w1.trace"
    trace = worker._AllocationTrace(out)
    try:
        trace.tick()  # the base
        kept = [bytearray(1024) for _ in range(512)]  # 512 KiB made after it, and alive at the end
        trace.write()
    finally:
        tracemalloc.stop()
    report = out.read_text()
    first, *rest = report.splitlines()
    base, end, peak = (int(part.split()[-2]) for part in first.split(", "))
    assert end - base >= 500 and peak >= end - base, report
    growth = rest[: next(i for i, line in enumerate(rest[1:], 1) if not line.startswith(" "))]
    assert growth[0].startswith("+5") and "test_worker_trace.py" in "".join(growth), report  # the largest: ours
    assert len(kept) == 512
