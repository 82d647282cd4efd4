"""Bearer tokens to identities, and what an identity may see.

Each token is one client identity. A client's leases are stored under the owner ``identity/owner`` (or
just ``identity`` when it names no owner), so that its keys and leases are its own: another client that
sends the same key looks it up under its own identity and can never reach, extend or release them, and
"not yours" reads exactly like "not found". Admin tokens may also manage semaphores and revoke anyone's
lease.

With no tokens configured (open mode, loopback only) there is one identity that may do everything and
owners are stored as given, so the service and the embedded library see the same keys.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from permits import _validate
from permits._exceptions import Forbidden, InvalidArgument, Unauthorized
from permits.server.config import MAX_IDENTITY_LENGTH, ServerConfig

OPEN_IDENTITY = "local"
#: The longest owner a client may name on a service with tokens: ``identity/owner`` must fit where the
#: library's longest owner fits, whatever the identity. The same for every token, so that the OpenAPI
#: document can state it.
SCOPED_OWNER_LENGTH = _validate.MAX_OWNER_LENGTH - MAX_IDENTITY_LENGTH - 1


@dataclass(frozen=True, slots=True)
class Identity:
    name: str
    admin: bool
    #: owners are prefixed with the identity (every mode with tokens)
    scoped: bool

    def db_owner(self, owner: str | None, field: str = "owner") -> str:
        """The owner a lease is stored under, for the owner a client asked for (``field`` names it in an
        error)."""
        if not self.scoped:
            return owner if owner is not None else self.name
        if owner is None:
            return self.name
        if isinstance(owner, str) and len(owner) > SCOPED_OWNER_LENGTH:
            raise InvalidArgument(
                f"{field} is {len(owner)} characters long; the most on a service with tokens is"
                f" {SCOPED_OWNER_LENGTH} (it is stored under your identity)",
                field=field,
            )
        return f"{self.name}/{owner}"

    def client_owner(self, db_owner: str, asked: str | None) -> str:
        """The owner to show the client: the one it asked for, never its identity prefix."""
        if not self.scoped:
            return db_owner
        return asked if asked is not None else self.name

    def owns(self, db_owner: str) -> bool:
        return not self.scoped or db_owner == self.name or db_owner.startswith(self.name + "/")

    def require_admin(self, action: str) -> None:
        if not self.admin:
            raise Forbidden(f"{action} needs an admin token; {self.name!r} is a client token", identity=self.name)


class Authenticator:
    def __init__(self, config: ServerConfig) -> None:
        self._by_digest = {entry.digest(): Identity(entry.name, entry.admin, True) for entry in config.tokens}
        self.open_mode = config.open_mode

    def identify(self, authorization: str | None) -> Identity:
        """The identity for an ``Authorization`` header, or ``Unauthorized``."""
        if self.open_mode:
            return Identity(OPEN_IDENTITY, admin=True, scoped=False)
        if not authorization:
            raise Unauthorized("this service needs a bearer token: Authorization: Bearer <token>")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("the Authorization header must be: Bearer <token>")
        # Looked up by the token's SHA-256, so the secrets themselves are never kept in memory as keys and
        # a lookup takes the same time whichever token is close to a right one.
        identity = self._by_digest.get(hashlib.sha256(token.strip().encode()).hexdigest())
        if identity is None:
            raise Unauthorized("unknown token")
        return identity
