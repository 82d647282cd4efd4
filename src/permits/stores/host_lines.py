"""Lines beside a SQLite database: first come, first served, among the processes and threads of its host.

SQLite lets one writer in at a time and keeps no queue. A connection that finds the write lock taken
sleeps in its busy handler (1 ms at first, then up to 100 ms) and tries again, and a process that commits
and writes again at once takes the lock in those gaps while the others sleep. Four processes acquiring
and releasing one semaphore saw single cycles of 1.1-2.2 s; at 64, a few processes took most of the grants
(docs/benchmarks.md, "Lines for SQLite"). PostgreSQL has a line for this in the server's lock queue;
SQLite has no server, but a WAL database is shared by the processes of one host only, so a line kept in a
file beside it reaches every client that matters. Two kinds of line live in that file
(``<database>-permits-lines``), and the SQL store uses both (stores/direct.py, ``try_acquire``):

- **The write line.** Every write transaction takes its turn before its ``BEGIN IMMEDIATE``, so the
  database's write lock goes round in order, and no writer sleeps while it is free.
- **A semaphore's line.** A waiting acquire of one permit of one semaphore takes its turn in that semaphore's
  line, and at its head asks again until room comes back, as PostgreSQL's queued grant does. A new acquire
  asks outside the line only while nobody is in it, so it cannot take the room the line is owed. On a fair
  semaphore the line's waiters take no place in its fair queue while the line, which orders them, serves them
  (the store's ``_try_in_host_line``). On a plain semaphore, one refused at the head twice in a row (the
  permits are held for longer than it waits there) then waits outside the line, polling with backoff, as
  before the lines; on a fair one the head takes a place instead, and waits by it. Semaphores
  share ``SEMAPHORE_LINES`` lines by their name's hash: the waiters of two that share one take turns at its
  head, where each waits for its own semaphore.

Each line is a CLH queue lock made of open file description locks (``F_OFD_SETLK``, Linux):

- The line's ticket counter is 8 bytes of the file. Under a lock on them, a client reads its ticket
  ``t``, locks the byte that is ticket ``t``'s place, writes ``t + 1``, and writes its ticket and the name
  of its wake socket (a Unix datagram socket in Linux's abstract namespace) in the slot of ``t``.
- It waits until the place before, ``t - 1``, is unlocked: it looks (``F_OFD_GETLK``), and sleeps on its
  socket between looks, at most ``RECHECK`` seconds at a time. The client ahead, at the end of its turn, unlocks
  its place and sends one datagram to the socket named in the next slot, so a hand-off wakes one process.
- The locks belong to one open file, so two threads of a process queue like two processes, and the
  kernel drops them when their process dies: a client killed in the line, or in its turn, hands the turn
  on (the next one finds out within ``RECHECK``). A forked child closes its copies of its parent's files.
- Abstract sockets belong to a network namespace: a client in another one (a container sharing the file)
  is not woken, and finds its turn by ``RECHECK`` alone.

The lines only order who asks. SQLite's own lock keeps writers apart and the semaphore row keeps the
count, as without them, so a line that fails only loses the order: a client that waits past its patience
(the one ahead was stopped, by SIGSTOP or Ctrl-Z) leaves the line and asks unordered, and the one behind it
moves up; where the file or its locks cannot be had, every client asks unordered, with one warning, and
tries the lines again ``RETRY_AFTER`` seconds later.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import socket
import struct
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from time import monotonic, sleep
from zlib import crc32

logger = logging.getLogger("permits.store")

#: Line 0 is the write line; semaphores share the next ``SEMAPHORE_LINES`` by their name's hash.
WRITE_LINE = 0
SEMAPHORE_LINES = 1023
#: Line ``i``'s ticket counter: 8 bytes, little-endian, at ``8 * i``.
COUNTER_LEN = 8
#: Where each waiter says where to wake it: ticket ``t`` of line ``i`` writes its ticket and its socket's
#: name in slot ``t % SLOTS`` of the line's slots. A slot taken over by a later ticket (over ``SLOTS``
#: waiters in one line) only means that its waiter finds its turn by ``RECHECK``.
SLOTS_AT, SLOTS, SLOT_LEN, NAME_LEN = 1 << 16, 256, 32, 16
#: Ticket ``t``'s place in line ``i`` is the byte at ``TICKETS_AT + i * TICKET_SPAN + t % TICKET_SPAN``. A
#: byte-range lock may lie past the end of a file, so the file stays small (about 8 MiB at most, sparse).
TICKETS_AT = 1 << 30
TICKET_SPAN = 1 << 40
#: A counter's lock is held for a read and two writes; a client that cannot take it within this long, or
#: within its turn's patience if that is shorter (the holder was stopped just then), goes without the line.
COUNTER_PATIENCE = 0.05
#: A waiter looks at the place before its own at least this often, in case its client died unheard.
RECHECK = 0.05
#: At most this many open files (each with its socket) are kept for the next turns.
SPARE_SEATS = 8
#: After the file or its locks failed (no file descriptor left, say), the lines are not used for this long,
#: then tried again: a failure that passes must not cost the order for the rest of the process's life.
RETRY_AFTER = 30.0
#: A failure is warned of once in this many seconds; the others are logged at debug level.
WARN_AGAIN_AFTER = 3600.0
#: ``struct flock`` on Linux: l_type, l_whence, l_start, l_len, l_pid (0 for open file description locks).
_FLOCK = "hhqqi4x"
_BUSY = (errno.EAGAIN, errno.EACCES)
_SOCKET_PREFIX = b"\0permits-line-"


def supported() -> bool:
    """Open file description locks and abstract Unix sockets: Linux."""
    return hasattr(fcntl, "F_OFD_SETLK") and hasattr(socket, "AF_UNIX") and struct.calcsize(_FLOCK) == 32


def semaphore_line(name: str) -> int:
    """The line a semaphore's waiters take turns in."""
    return 1 + crc32(name.encode()) % SEMAPHORE_LINES


def _flock(kind: int, start: int) -> bytes:
    length = COUNTER_LEN if start < SLOTS_AT else 1  # a counter's 8 bytes, or a place's one
    return struct.pack(_FLOCK, kind, os.SEEK_SET, start, length, 0)


def _lock(fd: int, start: int) -> bool:
    """Lock the byte at ``start`` (a counter's 8 bytes from a counter) for writing, on ``fd``'s open file
    description, without waiting. Returns whether it was taken."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, start))
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        raise
    return True


def _unlock(fd: int, start: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, start))


def _held(fd: int, start: int) -> bool:
    """Whether another open file holds a lock on the byte at ``start``. Only looks (``F_OFD_GETLK``), so a
    client that tests a place never gets in the way of the one that waits for it."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, start))
    return bool(struct.unpack(_FLOCK, answer)[0] != fcntl.F_UNLCK)


def _read_counter(fd: int, line: int) -> int:
    return int.from_bytes(os.pread(fd, COUNTER_LEN, line * COUNTER_LEN).ljust(COUNTER_LEN, b"\0"), "little")


def _place(line: int, ticket: int) -> int:
    return TICKETS_AT + line * TICKET_SPAN + ticket % TICKET_SPAN


def _slot(line: int, ticket: int) -> int:
    return SLOTS_AT + (line * SLOTS + ticket % SLOTS) * SLOT_LEN


@dataclass(eq=False)
class _Seat:
    """An open file of the lines, whose locks are its own, and the socket its client is woken on."""

    fd: int
    wake: socket.socket
    name: bytes

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(OSError):
            self.wake.close()


class HostLines:
    """The lines of the SQLite database at ``database`` (a file path)."""

    def __init__(self, database: str) -> None:
        self.path = f"{database}-permits-lines"
        self._mutex = threading.Lock()
        self._spare: list[_Seat] = []
        #: every seat of this process, spare or in a turn: a forked child closes them all (_after_fork)
        self._seats: set[_Seat] = set()
        self._closed = False
        #: ``monotonic()`` time until which the lines are not used, after a failure (see ``_give_up``)
        self._broken_until = 0.0
        #: ``monotonic()`` time of the last warning about a failure (see ``_give_up``)
        self._warned_at: float | None = None
        _ALL.add(self)

    @contextlib.contextmanager
    def turn(self, line: int, patience: float) -> Iterator[bool]:
        """Wait for a turn in ``line``, up to ``patience`` seconds, and hold it for the block. Yields whether
        the turn was had (``False``: the block runs without the line)."""
        seat = self._seat()
        ticket = None
        if seat is not None:
            try:
                ticket = self._enter(seat, line, patience)
            except BaseException:
                # Interrupted (Ctrl-C) with a place perhaps taken: closing the file drops its locks, so the
                # client behind is not left waiting on a place nobody will give up.
                self._close(seat)
                raise
        try:
            yield ticket is not None
        finally:
            if seat is not None:
                if ticket is None:
                    self._give_back(seat)
                else:
                    try:
                        self._leave(seat, line, ticket)
                    except BaseException:
                        self._close(seat)
                        raise
                    self._give_back(seat)

    def busy(self, line: int) -> bool:
        """Whether somebody is in ``line`` or has its turn: the last ticket given is still held."""
        seat = self._seat()
        if seat is None:
            return False
        try:
            return _held(seat.fd, _place(line, _read_counter(seat.fd, line) - 1))
        except OSError as exc:
            self._give_up(exc)
            return False
        finally:
            self._give_back(seat)

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            spare, self._spare = self._spare, []
        for seat in spare:
            self._close(seat)

    # ------------------------------------------------------------------------------------------------

    def _enter(self, seat: _Seat, line: int, patience: float) -> int | None:
        """Take a ticket and wait for its turn: the ticket, or ``None`` if the turn did not come (its place
        is given up then)."""
        try:
            ticket = self._take_ticket(seat, line, min(COUNTER_PATIENCE, patience))
            if ticket is None:
                return None
            if self._wait_for(seat, _place(line, ticket - 1), patience):
                return ticket
            # Not within patience: leave the line, so that the client behind moves up.
            _unlock(seat.fd, _place(line, ticket))
        except OSError as exc:
            self._give_up(exc)
        return None

    def _take_ticket(self, seat: _Seat, line: int, patience: float) -> int | None:
        """A ticket, its place locked and its socket named in its slot; ``None`` if the counter stayed
        locked past ``patience``."""
        fd, counter = seat.fd, line * COUNTER_LEN
        given_up = monotonic() + patience
        while not _lock(fd, counter):
            if monotonic() > given_up:
                return None
            sleep(0)  # its holder is between a read and a write: let it run
        try:
            ticket = _read_counter(fd, line)
            # Nobody else holds this place (tickets are unique within TICKET_SPAN), unless a client from
            # TICKET_SPAN tickets ago still waits: then go without the line.
            if not _lock(fd, _place(line, ticket)):
                return None
            os.pwrite(fd, ((ticket + 1) % (1 << 62)).to_bytes(COUNTER_LEN, "little"), counter)
            os.pwrite(fd, ticket.to_bytes(8, "little") + seat.name, _slot(line, ticket))
        finally:
            _unlock(fd, counter)
        return ticket

    def _wait_for(self, seat: _Seat, before: int, patience: float) -> bool:
        """Wait, up to ``patience``, until the place ``before`` is unlocked."""
        given_up = monotonic() + patience
        while _held(seat.fd, before):
            left = given_up - monotonic()
            if left <= 0:
                return False
            readable, _, _ = select.select([seat.wake], [], [], min(left, RECHECK))
            if readable:
                _drain(seat.wake)  # a wake-up, or one left from a turn that came without it
        return True

    def _leave(self, seat: _Seat, line: int, ticket: int) -> None:
        """End the turn, and wake the client behind if it has said where."""
        try:
            _unlock(seat.fd, _place(line, ticket))
            slot = os.pread(seat.fd, SLOT_LEN, _slot(line, ticket + 1))
        except OSError as exc:
            self._give_up(exc)
            return
        if len(slot) >= 8 + NAME_LEN and int.from_bytes(slot[:8], "little") == ticket + 1:
            # Never waits: a socket whose queue is full has a wake-up waiting already.
            with contextlib.suppress(OSError):
                seat.wake.sendto(b"w", _SOCKET_PREFIX + slot[8 : 8 + NAME_LEN])

    def _seat(self) -> _Seat | None:
        if self._closed or self._broken():
            return None
        with self._mutex:
            if self._spare:
                return self._spare.pop()
        fd = wake = None
        name = os.urandom(NAME_LEN // 2).hex().encode()
        # Opened and recorded under the mutex, which a fork waits for (_before_fork): a child forked in
        # between would keep a copy of the file that it does not know to close, and with it the locks.
        with self._mutex:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
                wake = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                wake.bind(_SOCKET_PREFIX + name)
                wake.setblocking(False)
            except OSError as exc:
                if fd is not None:
                    os.close(fd)
                if wake is not None:
                    wake.close()
                failed = exc
            else:
                seat = _Seat(fd, wake, name)
                self._seats.add(seat)
                return seat
        self._give_up(failed)
        return None

    def _give_back(self, seat: _Seat) -> None:
        with self._mutex:
            if not (self._closed or self._broken()) and len(self._spare) < SPARE_SEATS:
                self._spare.append(seat)
                return
        self._close(seat)

    def _close(self, seat: _Seat) -> None:
        with self._mutex:  # see _seat
            self._seats.discard(seat)
            seat.close()

    def _after_fork(self) -> None:
        """In a forked child: the seats' open files are its parent's too, and their locks with them (a lock
        of the parent's lasts while any copy is open). Close the child's copies and start afresh."""
        self._mutex = threading.Lock()  # perhaps copied while another thread held it
        for seat in self._seats:
            seat.close()
        self._seats, self._spare = set(), []

    def usable(self) -> bool:
        """Whether the lines are used now: not closed, nor given up for a while after a failure."""
        return not (self._closed or self._broken())

    def _broken(self) -> bool:
        return self._broken_until > 0.0 and monotonic() < self._broken_until

    def _give_up(self, exc: OSError) -> None:
        """Go without the lines for ``RETRY_AFTER`` seconds, and close the spare seats (the failure may be
        a lack of file descriptors). Warns at most once in ``WARN_AGAIN_AFTER``; failures in between (a
        file that cannot be opened stays so) are logged at debug level."""
        with self._mutex:
            if self._broken():
                return
            now = monotonic()
            self._broken_until = now + RETRY_AFTER
            warn = self._warned_at is None or now - self._warned_at >= WARN_AGAIN_AFTER
            if warn:
                self._warned_at = now
            spare, self._spare = self._spare, []
        for seat in spare:
            self._close(seat)
        logger.log(
            logging.WARNING if warn else logging.DEBUG,
            "permits cannot keep its lines at %s (%s): SQLite's writers and waiters ask unordered, and the"
            " lines are tried again in %g s",
            self.path,
            exc,
            RETRY_AFTER,
        )


def _drain(wake: socket.socket) -> None:
    with contextlib.suppress(OSError):
        for _ in range(64):
            wake.recv(16)


#: every HostLines of this process, for _after_fork
_ALL: weakref.WeakSet[HostLines] = weakref.WeakSet()
#: the HostLines whose mutex a fork under way holds (_before_fork)
_FORKING: list[HostLines] = []


def _before_fork() -> None:
    """Hold every HostLines' mutex across a fork, so that no seat is half opened or half closed in the
    child (see ``_seat``)."""
    held = list(_ALL)
    for lines in held:
        lines._mutex.acquire()
    _FORKING[:] = held


def _after_fork_in_parent() -> None:
    held, _FORKING[:] = list(_FORKING), []
    for lines in held:
        lines._mutex.release()


def _after_fork_in_child() -> None:
    _FORKING.clear()
    for lines in list(_ALL):
        lines._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
