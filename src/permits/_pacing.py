"""How a waiting acquire paces its attempts: a pure policy, shared by the sync and async loops.

A waiter that asks too often burns the database's time (and, on a hot semaphore, the time of every
grant behind it); one that asks too rarely leaves returned permits idle. Three signals decide:

- **Rechecks.** An attempt that finds no room is one statement. The transaction that finds out why (an
  earlier grant under the same key, expired leases to reclaim, the fair-queue place to keep) runs on the
  first attempt and then at most once a ``RECHECK_SECONDS``.
- **Place in a fair queue.** A queued request learns how many permits it is short of fitting. On
  PostgreSQL its place records its process's wake channel, and a release calls the waiters that fit now
  (see ``_async/listener.py``): the request sleeps until called, and only the queue's head wakes at a
  release. Elsewhere the shortfall falls only as permits come back, so the pacer measures how fast it
  falls and sleeps about half the predicted time; only the request one permit short listens for a
  release, and it asks again within half the time since it became that request (``NEXT_SINCE_SHARE``).
  Either way the rest of the queue stays asleep instead of stampeding at every release. On SQLite, where
  every attempt takes the database's write lock, a poll reads the shortfall first and asks only once it is
  0 (the store's ``try_acquire``).
- **The server's lock queue.** On PostgreSQL a waiter for several semaphores asks through the queued grant
  made for them: it takes its turn in the line of the first of them, then asks as below. A waiter for one
  permit of one semaphore asks through the queued grant: it sleeps in the
  server's lock queue, the semaphore's line, until the waiters ahead of it have been served, then asks
  with the count as their commits left it, and at the head of the line waits up to
  ``LINE_HEAD_WAIT_SECONDS`` for room (dialects/pg_functions.py); on a fair semaphore, that wait starts
  again each time a place in its fair queue ahead of it is served. On a single MariaDB server the line is
  a row lock, and the waiter takes its turn in one request and asks at the head in the next, on the same
  connection (dialects/mysql.py, LINE_WAIT). The line hands the turn on in order and
  with no wake-up message, so on a hot semaphore nobody sleeps while permits come back, and a process
  that releases and asks again queues behind those already waiting. A waiter refused ``IN_LINE_TRIES``
  times in a row at the head (the permits are held for longer than that) leaves the line and waits as
  below; each release that wakes it sends it back for one try. Plain semaphores promise no order past
  that; fair ones do. A waiting acquire's first attempt goes in the line too: asking ahead of it, a
  newcomer would take the permits that the waiters in the line are owed, and starve them (measured: Jain
  0.17 at 64 clients). In an empty line the turn comes at once, and the queued grant costs about 5% more
  than the plain one (``benchmarks/statement_cost.py``).
- **Lost races.** On PostgreSQL (and in the service) every waiter of a semaphore hears of every release.
  A waiter that was told of room and still found none lost a race to another waiter: it then spreads its
  next retries over a window that doubles with each lost race, as Ethernet spreads its retransmissions, so
  the waiters that wake together do not all ask together. After ``QUIET_AFTER_LOST_RACES`` lost races
  it stops listening for ``QUIET_SECONDS`` and polls: at that contention, hearing every release costs more
  than it saves (the listener then unsubscribes). A grant without a wait narrows the window again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from permits._backoff import WAIT_BACKOFF

#: The why-refused transaction runs at most this often per waiting request.
RECHECK_SECONDS = 1.0
#: Bounds on the sleep of a queued request that paces itself by its place.
QUEUE_MIN_SLEEP = 0.002
QUEUE_MAX_SLEEP = 1.0
#: A queued request one permit short (next, when a permit comes back) that paces itself by its place sleeps at
#: most this share of the time since it found itself there, however slowly its queue moved before. Its rate
#: measures how fast the queue was served, and on MariaDB nothing calls a waiter when its turn comes: so after
#: one slow holder, a next waiter that slept by a slow rate left the permit idle, the queue moved as slowly as
#: it had, and the rates stayed low. On MariaDB, six processes on a fair mutex held 20 ms (42 turns a second),
#: after one hold of 0.3 s: with the line's head that no longer keeps the row locked (dialects/mysql.py) but
#: without this share, 8 to 15 turns a second for 1 to 3 s (four runs of five); with both, back within 2 s,
#: from 19-39 in the first second. Holds of 100 ms, eight processes: 5.4 turns a second (of 10 possible)
#: before, 7.8 with both, for about 3.5 more attempts a turn (12 against 8.5); on SQLite 4.9 against 7.5
#: (docs/benchmarks.md, "A fair mutex through one slow hold").
NEXT_SINCE_SHARE = 0.5
#: A queued request that is called when its turn comes still asks at least this often: a call can be lost
#: (while the listener reconnects), and a waiter ahead can leave without a call (its place lapses).
CALLED_MAX_SLEEP = 1.0
#: The first lost race spreads retries over this many seconds; each further one doubles it, up to the cap.
RACE_SPREAD_BASE = 0.002
RACE_SPREAD_CAP = 0.5
#: This many lost races in a row, and the waiters of a semaphore poll instead of listening for a while.
QUIET_AFTER_LOST_RACES = 2
QUIET_SECONDS = 30.0
#: This many refusals in a row in the server's lock queue, and a waiter waits for a release instead.
IN_LINE_TRIES = 2
#: How long a waiter at the head of the server's lock queue waits there for room, at most.
LINE_HEAD_WAIT_SECONDS = 0.05
#: After an attempt that asked outside the line found it busy (or no room), a store's first attempts on that
#: semaphore go straight into the line for this long: on a hot semaphore, asking outside first costs a round
#: trip more and is seldom granted.
LINE_BUSY_SECONDS = 1.0
#: At most this many attempts of one client wait in the server's lock queues at once: each holds one of the
#: client's pooled connections (five, and ten more for bursts) while it waits. The rest ask outside the line.
LINE_SEATS = 4


@dataclass
class WaitPacer:
    """The state of one waiting acquire. Times are ``monotonic()`` seconds, passed in by the caller."""

    lost_races: int = 0
    #: Until this ``monotonic()`` time, do not listen for releases (too contended to be worth it).
    quiet_until: float = 0.0
    rng: random.Random | None = None
    refusals: int = 0
    rechecked_at: float | None = None
    short: int | None = None
    #: How fast this request's shortfall falls, in permits per second (smoothed); None: not measured yet.
    rate: float | None = None
    _short_at: float = 0.0
    #: when an attempt first found the request one permit short, in a run of attempts that did
    _next_since: float | None = field(default=None, repr=False)
    _woken: bool = field(default=False, repr=False)
    #: refusals in a row of a request that fitted its fair queues (``short`` 0 or less): something else
    #: holds it back, such as a plain semaphore of the same request that is full
    fitting_refusals: int = 0
    #: refusals in a row of attempts made in the server's lock queue
    in_line_refusals: int = 0
    _in_line: bool = field(default=False, repr=False)

    def recheck_due(self, now: float) -> bool:
        """Whether the next attempt should run the full why-refused check; if so, it counts as done now."""
        if self.rechecked_at is None or now - self.rechecked_at >= RECHECK_SECONDS:
            self.rechecked_at = now
            return True
        return False

    def force_recheck(self) -> None:
        """The outcome of the last attempt is uncertain (a conflict or a failure): check fully next time."""
        self.rechecked_at = None

    def refused(self, now: float, short: int | None) -> None:
        """An attempt found no room. ``short``: the request's shortfall in its fair queues, if queued."""
        self.refusals += 1
        if self._in_line:
            self.in_line_refusals += 1
            self._in_line = False
        if self._woken:
            self.lost_races += 1
            self._woken = False
            if self.lost_races >= QUIET_AFTER_LOST_RACES:
                self.quiet_until, self.lost_races = now + QUIET_SECONDS, 0
        if short is not None and self.short is not None and now > self._short_at:
            sample = max(0, self.short - short) / (now - self._short_at)
            self.rate = sample if self.rate is None else 0.5 * self.rate + 0.5 * sample
        if short is None:
            self.rate = None
        if short != 1:
            self._next_since = None
        elif self._next_since is None:
            self._next_since = now
        self.fitting_refusals = self.fitting_refusals + 1 if short is not None and short <= 0 else 0
        self.short, self._short_at = short, now

    def in_line_next(self) -> bool:
        """Where the store can queue the next attempt on the server (``queues_in_line``): whether it goes in
        that queue; after a refusal, that means asking again at once rather than sleeping. Not for a request
        in a fair queue, which waits for its turn there, nor after ``IN_LINE_TRIES`` refusals in a row in
        the line (``woken`` then allows one more)."""
        self._in_line = self.short is None and self.in_line_refusals < IN_LINE_TRIES
        return self._in_line

    def granted(self) -> None:
        if self.refusals == 0:
            self.lost_races = max(0, self.lost_races - 1)

    def next_sleep(self, now: float) -> tuple[float, bool]:
        """How long to sleep before the next attempt, and whether a release may end the sleep early."""
        listen = now >= self.quiet_until
        backoff = WAIT_BACKOFF.delay(self.refusals - 1, self.rng)
        if self.short is None:
            return backoff, listen
        if self.short <= 0:
            if self.fitting_refusals <= 1:
                return 0.0, False  # it fits now: room came back between the attempt and the place read
            # It fitted its fair queues and was refused again: the room it lacks is elsewhere (another
            # semaphore of the request is full). Asking at once would loop, a write each time.
            return WAIT_BACKOFF.delay(self.fitting_refusals - 2, self.rng), listen
        # Only the request one permit short listens: the next permit back is its own.
        listen = listen and self.short == 1
        if not self.rate:
            sleep = min(backoff, QUEUE_MAX_SLEEP)
        else:
            sleep = min(QUEUE_MAX_SLEEP, max(QUEUE_MIN_SLEEP, self.short / self.rate / 2))  # half the predicted time
        if self._next_since is not None:
            sleep = min(sleep, max(QUEUE_MIN_SLEEP, NEXT_SINCE_SHARE * (now - self._next_since)))
        return sleep, listen

    def waits_turn(self) -> bool:
        """The request holds a place in a fair queue and does not fit yet: if the store calls it when its
        turn comes, it sleeps until then (up to ``CALLED_MAX_SLEEP``) instead of following ``next_sleep``."""
        return self.short is not None and self.short > 0

    def woken(self, called: bool = False) -> float:
        """A release ended the sleep early. Returns how long to wait before asking: 0 until a race was
        lost, then a random time within the spread window. A request ``called`` because its turn came
        lost no race when it finds no room after all: the release called only those that fit."""
        # Room came back: one more try in the line. (Not a whole new run of them: every waiter of the
        # semaphore hears each release, and all but one are refused.)
        self.in_line_refusals = min(self.in_line_refusals, IN_LINE_TRIES - 1)
        if called:
            return 0.0
        self._woken = True
        if self.lost_races == 0:
            return 0.0
        window = min(RACE_SPREAD_CAP, RACE_SPREAD_BASE * 2.0 ** min(self.lost_races - 1, 32))
        draw = self.rng.random() if self.rng is not None else random.random()
        return window * draw
