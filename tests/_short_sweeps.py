"""Testing only: ``python -m tests._short_sweeps serve --db URL ...`` is the permits command, with each
maintenance run of the sweep given ``PERMITS_TEST_SWEEP_SHARE`` of its lease's TTL instead of half of it:
a backlog a test can build in seconds then takes many runs, which the instances' election shares out."""

from __future__ import annotations

import os

from permits.cli import main
from permits.server import maintenance

if __name__ == "__main__":
    maintenance.SWEEP_RUN_SHARE = float(os.environ["PERMITS_TEST_SWEEP_SHARE"])
    main()
