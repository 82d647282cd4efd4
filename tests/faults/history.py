"""The history of a fault run: every operation of every process, as JSON lines, merged for the checker.

Each process appends to a file of its own (no locking between processes, and a SIGKILL loses nothing that
was written: each line is one ``write`` to a line-buffered file). An operation is two lines, Jepsen
style: ``invoke`` just before it starts and ``complete`` just after it ends, so an operation cut short by
a SIGKILL still shows that it began::

    {"ev": "invoke", "id": "w3-17", "op": "acquire", "proc": "w3", "pid": 4242, "t": 12.5, "key": ..., ...}
    {"ev": "complete", "id": "w3-17", "t": 12.6, "outcome": "ok", "token": 41, ...}

Times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for the whole machine, so times of different
processes compare). Outcomes: ``ok`` (it happened), ``fail`` (it definitely did not happen: no room, a
refused token, a lost lease), ``unknown`` (a timeout or a connection error: it may or may not have
happened). Events that are not operations of a worker (a fault the harness injected, a kill) are
``{"ev": "event", ...}`` lines.

``merge`` pairs invokes with their completions. An invoke that never completed (its process was killed,
or hung) becomes an ``unknown`` operation that ends at the kill, or never.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, FAIL, UNKNOWN = "ok", "fail", "unknown"


class Recorder:
    """Appends one process's history to ``path``."""

    def __init__(self, path: Path, proc: str) -> None:
        self.proc = proc
        self.pid = os.getpid()
        self._file = path.open("a", buffering=1)
        self._seq = 0
        self._lock = threading.Lock()  # the harness records from several threads

    def invoke(self, op: str, **fields: Any) -> str:
        self._seq += 1
        op_id = f"{self.proc}-{self._seq}"
        self._write({"ev": "invoke", "id": op_id, "op": op, "proc": self.proc, "pid": self.pid, **fields})
        return op_id

    def complete(self, op_id: str, outcome: str, **fields: Any) -> None:
        self._write({"ev": "complete", "id": op_id, "outcome": outcome, **fields})

    def event(self, kind: str, **fields: Any) -> None:
        self._write({"ev": "event", "kind": kind, "proc": self.proc, **fields})

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            record["t"] = time.monotonic()
            self._file.write(json.dumps(record, default=str) + "\n")

    def close(self) -> None:
        self._file.close()


@dataclass
class Op:
    """One operation, invoke and completion merged."""

    id: str
    op: str  # acquire, release, write
    proc: str
    t0: float
    t1: float  # math.inf when it never completed
    outcome: str
    fields: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.fields.get(name)


@dataclass
class History:
    ops: list[Op]
    events: list[dict[str, Any]]

    def of(self, op: str) -> list[Op]:
        return [o for o in self.ops if o.op == op]

    def met(self, kind: str, procs: Collection[str] | None = None, window: float = 1.0) -> list[Op]:
        """The operations of ``procs`` (all, by default: the processes the fault can reach) under way at some
        point of the ``window`` seconds from a fault of ``kind`` (an event the harness recorded)."""
        starts = [e["t"] for e in self.events if e["kind"] == kind]
        return [
            o
            for o in self.ops
            if (procs is None or o.proc in procs) and any(o.t0 <= t + window and o.t1 >= t for t in starts)
        ]

    def held_up(self, kind: str, procs: Collection[str] | None = None) -> list[Op]:
        """Of ``procs``' operations, those that a fault of ``kind`` that lasts held up: under way when it
        ended (the harness records ``<kind>_end`` then: the server back, the link resumed), having begun
        while it lasted or before, or left with an unknown outcome by it. A test asserts that some exist,
        so that its clean report is about work the fault actually hit."""
        starts = [e["t"] for e in self.events if e["kind"] == kind]
        ends = [e["t"] for e in self.events if e["kind"] == f"{kind}_end"]
        spans = [(t, min((u for u in ends if u >= t), default=math.inf)) for t in starts]
        return [
            o
            for o in self.ops
            if (procs is None or o.proc in procs)
            and any(o.t0 <= end and (o.t1 >= end or (o.outcome == UNKNOWN and o.t1 >= start)) for start, end in spans)
        ]

    def killed_at(self) -> dict[str, float]:
        """When each killed process was killed."""
        return {e["target"]: e["t"] for e in self.events if e["kind"] == "kill"}


def build(records: list[dict[str, Any]]) -> History:
    """Pair invokes with completions (``records`` in any order)."""
    invokes: dict[str, dict[str, Any]] = {}
    completes: dict[str, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    for record in records:
        if record["ev"] == "invoke":
            invokes[record["id"]] = record
        elif record["ev"] == "complete":
            completes[record["id"]] = record
        else:
            events.append(record)
    events.sort(key=lambda e: e["t"])
    killed = {e["target"]: e["t"] for e in events if e["kind"] == "kill"}
    ops = []
    for op_id, inv in invokes.items():
        done = completes.get(op_id)
        fields = {k: v for k, v in inv.items() if k not in ("ev", "id", "op", "proc", "t")}
        if done is None:
            t1, outcome = killed.get(inv["proc"], math.inf), UNKNOWN
            fields["never_completed"] = True
        else:
            t1, outcome = done["t"], done["outcome"]
            fields.update({k: v for k, v in done.items() if k not in ("ev", "id", "outcome", "t")})
        ops.append(Op(op_id, inv["op"], inv["proc"], inv["t"], t1, outcome, fields))
    ops.sort(key=lambda o: o.t0)
    return History(ops, events)


def merge(directory: Path) -> History:
    """Read every ``*.jsonl`` file of ``directory``; a line cut short by a kill (no newline) is dropped."""
    records = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines(keepends=True):
            if line.endswith("\n"):
                records.append(json.loads(line))
    return build(records)
