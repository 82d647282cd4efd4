"""Pure backoff policies, shared by the sync and async loops (only the sleep differs)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter: attempt n waits a random time in [d/2, d], d = min(cap, base * 2**n).

    Keeping half of the delay fixed bounds how soon a waiter comes back (it does not hammer the database),
    and the random half spreads waiters that were refused together, so they do not come back together.
    """

    base: float = 0.01
    cap: float = 1.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        ceiling = min(self.cap, self.base * (2.0 ** min(attempt, 32)))
        jitter: float = rng.random() if rng is not None else random.random()
        return ceiling * (0.5 + 0.5 * jitter)


#: Between retries of a transaction that hit a deadlock, a serialization failure or a dropped connection.
RETRY_BACKOFF = Backoff(base=0.005, cap=0.5)
#: Between attempts of an ``acquire`` that is waiting for room.
WAIT_BACKOFF = Backoff(base=0.02, cap=1.0)
#: Between attempts of a waiting ``acquire`` while the database (or the service) is unavailable: each
#: attempt already spent the store's own quick retries, so these come back within seconds of a restart
#: without a fleet of waiters reconnecting in step.
OUTAGE_BACKOFF = Backoff(base=0.25, cap=4.0)
