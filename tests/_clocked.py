"""Testing only: ``python -m tests._clocked serve --db URL ...`` is the permits command, with every MariaDB or
PostgreSQL store it opens on the server offset clock that the test process moves
(``permits.dialects.server_clock``): the service the model test talks to runs with time in it."""

from __future__ import annotations

from permits.cli import main
from permits.dialects.server_clock import following_clock

if __name__ == "__main__":
    with following_clock():
        main()
