"""Input checks. Pure: every public entry point runs its arguments through here before any I/O, so bad
input gets a typed ``InvalidArgument`` and nothing is written."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import TypeAlias

from permits._exceptions import InvalidArgument
from permits._models import Want

#: Names, keys and owners are at most this many characters. The columns hold 255 characters on every
#: backend; MariaDB indexes them with a binary, no-pad collation so that comparison is byte-exact.
MAX_NAME_LENGTH = 255
MAX_KEY_LENGTH = 255
MAX_OWNER_LENGTH = 255
#: the column is VARCHAR(64): a uuid4 in hex is 32
MAX_REQUEST_ID_LENGTH = 64
MAX_REASON_LENGTH = 1000
#: Leases live at most 30 days: longer is almost always a unit mistake (milliseconds passed as seconds).
MAX_TTL_SECONDS = 30 * 24 * 3600.0
#: The database clock is kept in milliseconds.
MIN_TTL_SECONDS = 0.001
#: Large enough for any real pool of resources, small enough that sums stay exact in a signed 64-bit
#: column and in a JavaScript number.
MAX_CAPACITY = 2**53 - 1
#: How many different semaphores one request may name.
MAX_WANTS = 64

WantsLike: TypeAlias = "str | Want | tuple[str, int] | Mapping[str, int] | Iterable[Want | tuple[str, int] | str]"
Seconds: TypeAlias = "float | int | timedelta"


def _text(value: object, field: str, max_length: int, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a string, not {type(value).__name__}", field=field)
    if not value:
        raise InvalidArgument(f"{what} must not be empty", field=field)
    if len(value) > max_length:
        raise InvalidArgument(
            f"{what} is {len(value)} characters long; the most is {max_length}", field=field, value=value[:64]
        )
    if "\x00" in value:
        raise InvalidArgument(f"{what} must not contain a NUL character", field=field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what} is not valid Unicode text (lone surrogate)", field=field) from None
    return value


def name(value: object, field: str = "name") -> str:
    return _text(value, field, MAX_NAME_LENGTH, "a semaphore name")


def key(value: object) -> str:
    return _text(value, "key", MAX_KEY_LENGTH, "a lease key")


def request_id(value: object) -> str:
    """The id of a request for a new lease only (``new_only``), the same in each of its tries."""
    return _text(value, "request_id", MAX_REQUEST_ID_LENGTH, "a request id")


def owner(value: object) -> str:
    return _text(value, "owner", MAX_OWNER_LENGTH, "an owner")


def who(value: object) -> str:
    """Who made a change, as the capacity history records it."""
    return _text(value, "who", MAX_OWNER_LENGTH, "who")


def reason(value: object, required: bool = False) -> str:
    """A reason for the record. ``required``: an action that must say why (a revoke, a capacity change)
    gets no blank one."""
    if not isinstance(value, str):
        raise InvalidArgument(f"a reason must be a string, not {type(value).__name__}", field="reason")
    if len(value) > MAX_REASON_LENGTH:
        raise InvalidArgument(f"a reason is at most {MAX_REASON_LENGTH} characters", field="reason")
    if "\x00" in value:
        raise InvalidArgument("a reason must not contain a NUL character", field="reason")
    if required and not value.strip():
        raise InvalidArgument("this action needs a reason, not a blank one", field="reason")
    return value


def _whole(value: object, field: str, what: str, low: int, high: int) -> int:
    # bool is an int subclass: True would silently mean 1 permit.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what} must be a whole number, not {type(value).__name__}", field=field)
    if value < low:
        raise InvalidArgument(f"{what} must be at least {low}, got {value}", field=field)
    if value > high:
        raise InvalidArgument(f"{what} must be at most {high}, got {value}", field=field)
    return int(value)  # an int subclass (an IntEnum member) is stored, and returned, as the number it is


def capacity(value: object) -> int:
    return _whole(value, "capacity", "a capacity", 1, MAX_CAPACITY)


def count(value: object) -> int:
    return _whole(value, "count", "a count", 1, MAX_CAPACITY)


def batch_size(value: object, field: str = "batch_size") -> int:
    return _whole(value, field, "a batch size" if field == "batch_size" else field, 1, 100_000)


def flag(value: object, field: str) -> bool:
    """True or False, nothing else: ``exist_ok="no"`` is truthy, and would do the opposite of what it says."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{field} must be True or False, not {type(value).__name__}", field=field)
    return value


def _seconds(value: object, field: str, what: str) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number of seconds, not {type(value).__name__}", field=field)
    try:
        seconds = float(value)
    except OverflowError:  # an int past any float: 10**400
        raise InvalidArgument(
            f"{what} must be a finite number of seconds, got an integer of {int(value).bit_length()} bits", field=field
        ) from None
    if math.isnan(seconds) or math.isinf(seconds):
        raise InvalidArgument(f"{what} must be a finite number of seconds, got {value}", field=field)
    return seconds


def ttl_ms(value: object) -> int:
    """A lease TTL in whole milliseconds (rounded up, so a lease never lives less than asked)."""
    seconds = _seconds(value, "ttl", "a ttl")
    if seconds < MIN_TTL_SECONDS:
        raise InvalidArgument(f"a ttl must be at least {MIN_TTL_SECONDS} s, got {seconds}", field="ttl")
    if seconds > MAX_TTL_SECONDS:
        raise InvalidArgument(f"a ttl must be at most {MAX_TTL_SECONDS:.0f} s (30 days), got {seconds}", field="ttl")
    return math.ceil(round(seconds * 1000, 6))


def timeout(value: object, field: str = "timeout", *, inf_is_none: bool = False) -> float | None:
    """``None`` waits for ever; otherwise a number of seconds >= 0. ``field`` names the argument in the
    error (``max_hold`` is a span of seconds too). With ``inf_is_none``, ``math.inf`` is for ever too, as
    trio's and anyio's deadlines take it (a caller's ``timeout = math.inf if patient else 5``)."""
    if value is None or (inf_is_none and isinstance(value, float) and value == math.inf):
        return None
    what = "a timeout" if field == "timeout" else field
    seconds = _seconds(value, field, what)
    if seconds < 0:
        raise InvalidArgument(f"{what} must not be negative, got {seconds}", field=field)
    return seconds


def max_hold(value: object) -> float | None:
    """``None`` (or ``math.inf``): no bound; otherwise a number of seconds > 0. Zero would grant a lease
    that is lost as it starts."""
    hold = timeout(value, "max_hold", inf_is_none=True)
    if hold == 0:
        raise InvalidArgument("max_hold must be more than 0 s (None: no bound)", field="max_hold")
    return hold


def reply_timeout(value: object, lock_wait_timeout: float) -> float | None:
    """``None``: the default. An operation may meet two lock waits (a row lock, and on MariaDB an insert's
    AUTO-INC lock): a deadline within them would cut statements that only wait their turn, on every retry."""
    if value is None:
        return None
    seconds = _seconds(value, "reply_timeout", "reply_timeout")
    if seconds <= 2 * lock_wait_timeout:
        raise InvalidArgument(
            f"reply_timeout must be more than twice lock_wait_timeout ({2 * lock_wait_timeout:g} s), got {seconds:g}:"
            " an operation may wait for two locks",
            field="reply_timeout",
        )
    return seconds


def wants(value: object) -> tuple[Want, ...]:
    """A request as wants sorted by name: the order rows are locked in, so that two multi-semaphore
    acquires can never wait on each other in a cycle."""
    items: list[Want] = []
    if isinstance(value, str | Want):
        raw: Iterable[object] = [value]
    elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and not isinstance(value[1], str):
        raw = [value]  # one (name, count) pair, as written in a list of them: ("backups", 2)
    elif isinstance(value, bytes | bytearray):
        raise InvalidArgument("a request names semaphores as text (str), not bytes", field="wants")
    elif isinstance(value, Mapping):
        raw = list(value.items())
    elif isinstance(value, Iterable):
        raw = list(value)
    else:
        raise InvalidArgument(
            f"a request must be a name, a {{name: count}} mapping or a list of them, not {type(value).__name__}",
            field="wants",
        )
    for item in raw:
        if isinstance(item, Want):
            items.append(Want(name(item.name), count(item.count)))
        elif isinstance(item, str):
            items.append(Want(name(item), 1))
        elif isinstance(item, tuple) and len(item) == 2:
            items.append(Want(name(item[0]), count(item[1])))
        else:
            raise InvalidArgument(f"cannot read {item!r} as a (name, count) want", field="wants")
    if not items:
        raise InvalidArgument("a request must name at least one semaphore", field="wants")
    if len(items) > MAX_WANTS:
        raise InvalidArgument(f"a request may name at most {MAX_WANTS} semaphores", field="wants")
    names = [w.name for w in items]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise InvalidArgument(f"a request names the same semaphore twice: {twice[0]!r}", field="wants")
    return tuple(sorted(items, key=lambda w: w.name))
