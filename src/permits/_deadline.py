"""The caller's deadline, for the stores' retries and reply bounds.

An ``acquire(timeout=3)`` waits up to 3 s for room. Over a link that hangs (a stalled proxy, a dropped NAT
entry, a frozen server) each of its attempts would instead wait for its reply up to the reply deadline
(20 s by default) and be retried after it, five times: two minutes. The client sets the deadline here for
the operations it makes on the caller's behalf, and the stores hold to it: past the deadline and a grace,
an attempt's reply is waited for no longer and a lost connection is not tried again, and the call raises
``StorageUnavailable`` (``ServiceUnavailable``) as when the retries run out.

The grace is room for an answer that is merely late: an attempt's row-lock wait is bounded by the time
left (``flows.Request.lock_wait_ms``), but a try may wait for a whole lock wait, an insert on MariaDB for its
AUTO-INC lock besides, and a commit on a loaded server takes time; and an attempt, however late it is
sent, gets at least the time a healthy answer can take. A context variable, as ``GIVEN_UP`` is:
the stores' retry loops are many levels below the client's call, and the asyncio store's worker threads
(``asyncio.to_thread``) get a copy of the caller's context.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from time import monotonic

#: Seconds past an operation's deadline, beyond one lock wait, after which a SQL store stops waiting for
#: answers and trying again (``store_grace``).
OVERDUE_GRACE_SECONDS = 5.0

#: When (``monotonic()`` time) the caller's wait ends: set by the client around what it does for a call
#: with a timeout. ``None``: the caller waits for ever, and the stores' own bounds apply alone.
CALLER_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("permits_caller_deadline", default=None)


class caller_deadline:
    """The stores' operations in the block hold to ``deadline``, or to an earlier one that an enclosing block
    set (a call made on behalf of another cannot outlast it). ``None``: no deadline of the block's own.

    A class rather than a generator: every acquire with a timeout enters one, and this costs a third of
    what ``contextlib.contextmanager`` does (docs/benchmarks.md)."""

    __slots__ = ("_deadline", "_token")

    def __init__(self, deadline: float | None) -> None:
        self._deadline = deadline
        self._token: contextvars.Token[float | None] | None = None

    def __enter__(self) -> None:
        deadline = self._deadline
        if deadline is None:
            return
        outer = CALLER_DEADLINE.get()
        if outer is None or deadline < outer:
            self._token = CALLER_DEADLINE.set(deadline)

    def __exit__(self, *_: object) -> None:
        if self._token is None:
            return
        try:  # noqa: SIM105 - _reset, inlined: on the path of every acquire with a timeout
            CALLER_DEADLINE.reset(self._token)
        except ValueError:  # see _reset
            pass


@contextlib.contextmanager
def without_caller_deadline() -> Iterator[None]:
    """The stores' operations in the block hold to no caller's deadline: for work done once for every caller
    (making the schema), which one caller's timeout must not cut short."""
    token = CALLER_DEADLINE.set(None)
    try:
        yield
    finally:
        _reset(token)


def _reset(token: contextvars.Token[float | None]) -> None:
    # Not contextlib.suppress, which costs more, on the path of every acquire with a timeout.
    try:  # noqa: SIM105
        CALLER_DEADLINE.reset(token)
    except ValueError:
        # A call dropped with its closed event loop ends in another context, where the token cannot be reset;
        # that context, and the variable's value in it, go with the call.
        pass


def store_grace(lock_wait_timeout: float) -> float:
    """How long past the caller's deadline a SQL store still waits for answers, and tries again: one lock
    wait (a grant's row-lock wait is bounded by the time left, but a try waits for a whole one) and
    ``OVERDUE_GRACE_SECONDS``."""
    return lock_wait_timeout + OVERDUE_GRACE_SECONDS


def store_least_reply(lock_wait_timeout: float) -> float:
    """The least time a SQL store's attempt waits for its answer, however late it is sent: two lock waits
    (MariaDB's row lock, then its AUTO-INC lock) and ``OVERDUE_GRACE_SECONDS``. An attempt sent late (a
    try after a long wait for a pooled connection or for the service's pre-lock, a retry just before the
    point of giving up) would otherwise be cut on a healthy but busy database, and not tried again."""
    return 2 * lock_wait_timeout + OVERDUE_GRACE_SECONDS


def give_up_at(grace: float) -> float | None:
    """When (``monotonic()`` time) a store stops waiting on this caller's behalf: ``grace`` seconds after its
    deadline. ``None``: no deadline."""
    deadline = CALLER_DEADLINE.get()
    return None if deadline is None else deadline + grace


def reply_within(reply_timeout: float, grace: float, least: float) -> float:
    """How long an attempt sent now may wait for its answer: the store's reply deadline, or less where the
    point of giving up comes sooner, but not less than ``least``."""
    deadline = CALLER_DEADLINE.get()
    if deadline is None:
        return reply_timeout
    left = deadline + grace - monotonic()
    return min(reply_timeout, least if left < least else left)


def past_giving_up(grace: float, pause: float = 0.0) -> bool:
    """Whether an attempt made after ``pause`` seconds would start past the point of giving up."""
    end = give_up_at(grace)
    return end is not None and monotonic() + pause >= end


def detached() -> contextvars.Context:
    """A copy of the current context without a caller's deadline, for work a call starts that outlives it
    and serves others (a semaphore's line in the service, a watchdog, a listener): it would otherwise hold
    to that one caller's deadline for good."""
    context = contextvars.copy_context()
    context.run(CALLER_DEADLINE.set, None)
    return context
