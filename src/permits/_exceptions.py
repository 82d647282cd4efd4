"""Everything permits raises, in one tree.

Each class has a stable ``code``: it is what the HTTP service puts on the wire, what the docs list and what
metrics count. ``error_class(code)`` maps a code back to its class, so a remote client raises the same
exception the embedded library would::

    PermitsError                                  base of everything permits raises
    ├── InvalidArgument (ValueError)              bad input, refused before anything is written
    │   └── CountExceedsCapacity                  asked for more permits than the semaphore can ever hold
    ├── ConfigurationError (ValueError)           bad URL, missing driver, bad setting
    ├── SemaphoreNotFound (LookupError)
    ├── SemaphoreExists
    ├── SemaphoreInUse                            delete refused while permits are held
    ├── AcquireTimeout (TimeoutError)             waited `timeout`, nothing was granted
    ├── IdempotencyConflict                       same key, different request
    │   └── KeyInUse                              a request for a new lease under a key that names one
    ├── LeaseError
    │   ├── LeaseNotFound (LookupError)           no lease was ever granted under this key
    │   ├── LeaseLost                             the lease ended: released, expired, swept or revoked
    │   └── StaleFencingToken                     a fenced write carried a token older than one accepted
    ├── StorageError                              the database failed; ``__cause__`` is the driver error
    │   ├── StorageUnavailable (retryable)        cannot connect, the connection dropped, or the pool had none free
    │   ├── StorageConflict (retryable)           deadlock, serialization failure, lock wait timeout, busy
    │   ├── StorageReadOnly                       a read-only replica was asked to write
    │   └── SchemaMismatch                        the schema is older or newer than this code
    ├── UsageError (RuntimeError)                 misuse: a closed client, a lease used after release
    └── ServiceError                              the HTTP service answered, but not with success
        ├── Unauthorized                          no token, or an unknown one (401)
        ├── Forbidden                             the token may not do this (403)
        ├── RequestTooLarge                       the request body is over the service's bound (413)
        ├── LimitExceeded (retryable)             a bound on waiters or leases was reached (429)
        └── ServiceUnavailable (retryable)        the instance is shutting down or overloaded (503)
"""

from __future__ import annotations

from typing import Any, ClassVar

_REGISTRY: dict[str, type[PermitsError]] = {}


class PermitsError(Exception):
    """Base of every exception permits raises.

    ``details`` holds the structured facts of the error (the semaphore's name, the lease's key, ...): they
    survive pickling and the trip over HTTP.
    """

    code: ClassVar[str] = "permits_error"
    #: whether repeating the same call later may succeed
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if code is not None:
            if code in _REGISTRY:  # pragma: no cover - a programming error caught at import
                raise TypeError(f"error code {code!r} is used twice")
            _REGISTRY[code] = cls

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.details))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[PermitsError], message: str, details: dict[str, Any]) -> PermitsError:
    return cls(message, **details)


_REGISTRY[PermitsError.code] = PermitsError


def error_class(code: str) -> type[PermitsError]:
    """The exception class for a stable error code; ``PermitsError`` for a code this version does not know."""
    return _REGISTRY.get(code, PermitsError)


def error_codes() -> dict[str, type[PermitsError]]:
    """Every stable error code and its class."""
    return dict(_REGISTRY)


class InvalidArgument(PermitsError, ValueError):
    """An argument is malformed or out of range. Nothing was written.

    ``details["field"]`` names the argument.
    """

    code = "invalid_argument"


class CountExceedsCapacity(InvalidArgument):
    """A want asks for more permits than the semaphore's capacity: it could never be granted."""

    code = "count_exceeds_capacity"


class ConfigurationError(PermitsError, ValueError):
    """The client cannot be set up: a bad URL, a driver that is not installed, a bad setting."""

    code = "configuration_error"


class SemaphoreNotFound(PermitsError, LookupError):
    """No semaphore of that name exists."""

    code = "semaphore_not_found"


class SemaphoreExists(PermitsError):
    """A semaphore of that name exists already."""

    code = "semaphore_exists"


class SemaphoreInUse(PermitsError):
    """The semaphore still has permits held; delete it with ``force=True`` to revoke them."""

    code = "semaphore_in_use"


class AcquireTimeout(PermitsError, TimeoutError):
    """``acquire`` waited for its whole ``timeout`` and nothing was granted."""

    code = "acquire_timeout"
    retryable = True


class IdempotencyConflict(PermitsError):
    """The key was used before for a different request."""

    code = "idempotency_conflict"


class KeyInUse(IdempotencyConflict):
    """A request that asked for a new lease only (``new_only``) found a lease under its key already, held
    or ended: ``details["held"]`` says which. Nothing was granted; that lease is left as it is."""

    code = "key_in_use"


class LeaseError(PermitsError):
    """Base of the errors about one lease."""

    code = "lease_error"


class LeaseNotFound(LeaseError, LookupError):
    """No lease was ever granted under this key for this owner (or it was cleaned up long ago)."""

    code = "lease_not_found"


class LeaseLost(LeaseError):
    """The lease has ended, so its permits and fencing tokens are no longer the holder's.

    ``details["reason"]`` says why: ``released``, ``expired``, ``swept`` or ``revoked``.
    """

    code = "lease_lost"

    @property
    def reason(self) -> str:
        return str(self.details.get("reason", ""))


class StaleFencingToken(LeaseError):
    """A fenced write carried a token lower than one its resource has accepted already: the writer's lease
    ended and a newer holder has written since (``permits.fencing``). ``details``: resource, token,
    highest."""

    code = "stale_fencing_token"


class StorageError(PermitsError):
    """The database failed in a way permits could not absorb. ``__cause__`` is the driver's error."""

    code = "storage_error"


class StorageUnavailable(StorageError):
    """The database cannot be reached, or the connection dropped and retries ran out, or no connection of
    the client's pool came free within the pool's timeout (then nothing was sent)."""

    code = "storage_unavailable"
    retryable = True


class StorageConflict(StorageError):
    """Deadlocks, serialization failures or lock waits kept happening until retries ran out."""

    code = "storage_conflict"
    retryable = True


class StorageReadOnly(StorageError):
    """The database refused a write because it is a read-only replica: point permits at the primary."""

    code = "storage_read_only"


class SchemaMismatch(StorageError):
    """The database schema is not the one this version needs: run ``permits db upgrade``."""

    code = "schema_mismatch"


class UsageError(PermitsError, RuntimeError):
    """The API was used in a way it does not support, such as a call on a closed client."""

    code = "usage_error"


class ServiceError(PermitsError):
    """The permits service answered with an error this client cannot place in the tree, or broke the
    protocol. Subclasses are the service's own refusals."""

    code = "service_error"


class Unauthorized(ServiceError):
    """The request carried no bearer token, or one the service does not know."""

    code = "unauthorized"


class Forbidden(ServiceError):
    """The token is valid but may not do this (managing semaphores and revoking leases need an admin token)."""

    code = "forbidden"


class RequestTooLarge(ServiceError):
    """The request body is larger than the service accepts."""

    code = "request_too_large"


class LimitExceeded(ServiceError):
    """A documented bound was reached: too many waiters on one instance, or too many leases for one client.

    ``details["limit"]`` names the bound.
    """

    code = "limit_exceeded"
    retryable = True


class ServiceUnavailable(ServiceError):
    """The service instance cannot take the request now (it is shutting down); another may."""

    code = "service_unavailable"
    retryable = True


#: An acquire's errors that are a verdict on the request, which ends it (``KeyInUse`` among them): its
#: places in fair queues go with it. Not an outage, nor a timeout (which gives its places up itself).
ENDS_THE_REQUEST: tuple[type[PermitsError], ...] = (InvalidArgument, SemaphoreNotFound, IdempotencyConflict, LeaseError)
