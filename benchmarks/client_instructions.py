"""Instructions the client process runs per acquire+release cycle, counted by valgrind's callgrind: the
measure of the library's own cost that a noisy shared VM does not move (docs/benchmarks.md, "a connection
kept for the statements that run alone"). CPU seconds per cycle (client_cpu.py) moved by 10-30% between
runs minutes apart on the 2-core VMs here; instruction counts repeat to within a fraction of a percent.

    python benchmarks/client_instructions.py postgresql://postgres@127.0.0.1:5432/permits_bench \\
        --src /path/to/a/checkout/src --src /path/to/another/src

For each ``--src`` (default: the installed permits), ``client_cpu.py`` runs twice under callgrind, with
``--few`` and with ``--many`` cycles (each after as many uncounted ones). Callgrind counts from the moment
the client has connected (``client_cpu.py --callgrind``): the interpreter's start-up and the imports run
uninstrumented, which takes a run on SQLite from 26 to 4 s. What is counted before the first cycle and
after the last costs the same in both runs, so the difference of the two totals, over the difference of
the cycles run, is what one cycle costs. What an instruction costs in time is not counted (cache misses,
the round trips), so this compares two versions of the client; it does not say how fast either is.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CLIENT_CPU = Path(__file__).with_name("client_cpu.py")
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def instructions(url: str, cycles: int, src: str | None, asyncio: bool = False) -> int:
    """The instructions callgrind counted in a whole run of client_cpu.py with ``cycles``."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",  # client_cpu.py --callgrind switches it on once connected
                f"--callgrind-out-file={scratch}/out",
                sys.executable,
                str(CLIENT_CPU),
                url,
                "--cycles",
                str(cycles),
                "--callgrind",
                *(["--asyncio"] if asyncio else []),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    found = _COLLECTED.search(done.stderr)
    if found is None:
        raise RuntimeError(f"callgrind reported no count:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def per_cycle(url: str, src: str | None, few: int, many: int, asyncio: bool = False) -> float:
    # client_cpu.py runs as many uncounted cycles before the counted ones: 2 * cycles in all.
    return (instructions(url, many, src, asyncio) - instructions(url, few, src, asyncio)) / (2 * (many - few))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="a permits database URL (sqlite:///..., mysql://..., postgresql://...)")
    parser.add_argument("--src", action="append", help="a permits src directory to measure (repeatable)")
    parser.add_argument("--few", type=int, default=100, help="cycles in the shorter run")
    parser.add_argument("--many", type=int, default=600, help="cycles in the longer run")
    parser.add_argument("--asyncio", action="store_true", help="the asyncio client (client_cpu.py --asyncio)")
    args = parser.parse_args()
    if args.many <= args.few:
        parser.error("--many must be more than --few")
    for src in args.src or [None]:
        count = per_cycle(args.url, src, args.few, args.many, args.asyncio)
        print(f"{src or 'installed permits'}: {count:,.0f} instructions per cycle")


if __name__ == "__main__":
    main()
