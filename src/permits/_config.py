"""Settings and URLs."""

from __future__ import annotations

import getpass
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from permits import _validate
from permits._exceptions import ConfigurationError, InvalidArgument

if TYPE_CHECKING:
    # Imported where a database URL is parsed, not here: a client of a service never needs SQLAlchemy,
    # and importing it is most of the start-up of a `permits run` through a service.
    from sqlalchemy.engine import URL

#: The embedded default: a SQLite file in the working directory.
DEFAULT_URL = "sqlite:///permits.db"
DEFAULT_TTL = 60.0
DEFAULT_LOCK_WAIT_TIMEOUT = 5.0
DEFAULT_RETRIES = 5
#: How long an operation's statement or transaction may go without its whole answer, beyond two lock waits
#: (``2 * lock_wait_timeout``), before the store takes its connection as lost (a stalled link, a hung
#: server) and drops it. Each lock wait is bounded by ``lock_wait_timeout``, and an operation meets one or
#: two (a row lock, and on MariaDB the AUTO-INC lock of an insert); the rest is room for a slow commit on a
#: loaded server. The bound is there to catch a hang, not to time operations: a legitimate statement cut
#: by it is retried like any other lost connection.
REPLY_GRACE_SECONDS = 10.0

_SCHEME_ALIASES = {"postgres": "postgresql", "pg": "postgresql"}
#: The schemes of a permits service's URL: served by the HTTP stores, parsed as a ``ServiceURL``.
SERVICE_SCHEMES = ("http", "https")
#: What the ``pooler`` parameter of a PostgreSQL URL may say: which kind of connection pooler (PgBouncer,
#: pgcat, Supavisor, RDS Proxy...) stands between permits and the server (docs/deployment.md, "Poolers").
Pooler = Literal["session", "transaction"]
POOLERS: tuple[Pooler, ...] = ("session", "transaction")


def default_owner() -> str:
    """``$PERMITS_OWNER``, else ``user@host``: stable across processes on one machine, so a key acquired by
    one command can be released by the next."""
    env = os.environ.get("PERMITS_OWNER")
    if env:
        return env
    try:
        user = getpass.getuser()
    except Exception:  # no login name in some containers
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"[: _validate.MAX_OWNER_LENGTH]


def parse_url(url: str | URL | ServiceURL | None) -> URL | ServiceURL:
    """The URL to use: the argument, else ``$PERMITS_DATABASE_URL``, else the embedded default. A service's
    URL becomes a ``ServiceURL``, any other a SQLAlchemy ``URL``."""
    if url is None:
        url = os.environ.get("PERMITS_DATABASE_URL") or DEFAULT_URL
    if isinstance(url, ServiceURL):
        return url
    if not isinstance(url, str):
        from sqlalchemy.engine import URL

        if not isinstance(url, URL):
            raise ConfigurationError("a database URL must be a non-empty string", field="url")
        if url.drivername.lower() in SERVICE_SCHEMES:  # a URL object made for a service: parse it as one
            return ServiceURL.parse(url.render_as_string(hide_password=False))
        return url
    if not url.strip():
        raise ConfigurationError("a database URL must be a non-empty string", field="url")
    scheme, sep, rest = url.partition("://")
    base, plus, driver = scheme.partition("+")
    if sep and base.lower() in SERVICE_SCHEMES:
        if plus:
            raise ConfigurationError(f"a service's URL takes no driver: {base}://, not {scheme}://", field="url")
        return ServiceURL.parse(url)
    if sep and base in _SCHEME_ALIASES:
        url = f"{_SCHEME_ALIASES[base]}{plus}{driver}{sep}{rest}"
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number, several hosts
        # Not shown: the URL may hold a password.
        raise ConfigurationError(
            "cannot parse the database URL (expected e.g. sqlite:///permits.db, or postgresql://user:pw@host:5432/db"
            " with one host and a numeric port)",
            field="url",
        ) from None
    if parsed.host is not None and "@" in parsed.host:
        # user:p@ss@host reads as the password "p" at the host "ss@host": the rest of the password would be
        # shown wherever the URL is, as part of the host. (httpx reads a service's URL up to the last '@'.)
        raise ConfigurationError(
            "the database URL has an '@' before its host: percent-encode an '@' in a user name or password as %40",
            field="url",
        )
    return parsed


@dataclass(frozen=True, slots=True)
class ServiceURL:
    """The URL of a permits service (``http://`` or ``https://``), parsed by httpx, which sends to it.

    Not a SQLAlchemy ``URL``, so that a client of a service runs without importing SQLAlchemy. It answers
    the two questions asked of any store's URL the way SQLAlchemy's does: ``get_backend_name()`` (the
    scheme, which picks the store) and ``render_as_string()``."""

    #: the URL as httpx renders it, password included
    text: str

    @classmethod
    def parse(cls, url: str) -> ServiceURL:
        import httpx

        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError, TypeError):
            raise ConfigurationError(
                "cannot parse the service's URL (expected e.g. http://127.0.0.1:8080 or https://permits.example)",
                field="url",
            ) from None
        if not parsed.host:
            raise ConfigurationError("a service's URL needs a host, as in http://127.0.0.1:8080", field="url")
        if parsed.port is not None and not 0 < parsed.port < 65536:
            raise ConfigurationError(f"a service's port must be from 1 to 65535, not {parsed.port}", field="url")
        return cls(str(parsed))

    def get_backend_name(self) -> str:
        return self.text.partition("://")[0]

    def has_parameter(self, name: str) -> bool:
        import httpx

        return name in httpx.URL(self.text).params

    def render_as_string(self, hide_password: bool = True) -> str:
        if not hide_password:
            return self.text
        import httpx

        url = httpx.URL(self.text)
        if url.password:
            url = url.copy_with(username=url.username, password="***")  # httpx drops what is not given
        secret = [name for name in url.params if name.lower() in SECRET_PARAMETERS]
        if secret:
            url = url.copy_with(params=url.params.merge({name: "***" for name in secret}))
        # httpx percent-encodes the mask in the query; shown as a password in its place is.
        return str(url).replace("=%2A%2A%2A", "=***")


#: Query parameters that carry a secret (libpq's and the MySQL drivers' spellings): masked like the password.
SECRET_PARAMETERS = ("password", "sslpassword", "passwd")


def redact(url: URL | ServiceURL) -> str:
    """The URL as it may appear in a message or a log: without its password, in its place or as a query
    parameter."""
    if isinstance(url, ServiceURL):
        return url.render_as_string(hide_password=True)
    # Case-blind: a driver may refuse PASSWORD=, but the message that says so must not show it.
    hidden = {name: "HIDDEN" for name in url.query if name.lower() in SECRET_PARAMETERS}
    shown = (url.update_query_dict(hidden) if hidden else url).render_as_string(hide_password=True)
    # As the password in its place shows (***), which the query would otherwise percent-encode.
    return shown.replace("=HIDDEN", "=***") if hidden else shown


@dataclass(frozen=True, slots=True)
class Settings:
    #: a database's URL, or a service's (``ServiceURL``)
    url: URL | ServiceURL
    owner: str
    #: the TTL of a lease acquired without one
    ttl_ms: int
    lock_wait_timeout: float = DEFAULT_LOCK_WAIT_TIMEOUT
    retries: int = DEFAULT_RETRIES
    #: create or upgrade the schema on first use; the default does it for SQLite only
    auto_upgrade: bool = False
    #: the bearer token for a permits service (http:// and https:// URLs); ``$PERMITS_TOKEN`` by default
    token: str | None = None
    #: the pooler in front of PostgreSQL, from the URL's ``pooler`` parameter (which ``url`` no longer has)
    pooler: Pooler | None = None
    #: database connections the store keeps open (``None``: SQLAlchemy's default, 5). Up to as many again
    #: open in a burst, and close when they come back to a full pool: a client that runs more operations at
    #: once than this pays a new connection for each one past it.
    pool_size: int | None = None
    #: the ``reply_timeout`` the caller gave (``None``: the default, see ``reply_timeout``)
    chosen_reply_timeout: float | None = None
    #: whether the caller chose ``ttl_ms``; if not, a store with a default of its own (a service's) sets it
    ttl_chosen: bool = True
    #: no extend sets an expiry further ahead than this (a service's ``limits.max_ttl``; ``None``: no bound)
    max_ttl_ms: int | None = None

    @property
    def reply_timeout(self) -> float:
        """Seconds an operation's statement or transaction may wait for its answer: as chosen, else two lock
        waits and ``REPLY_GRACE_SECONDS``."""
        if self.chosen_reply_timeout is not None:
            return self.chosen_reply_timeout
        return 2 * self.lock_wait_timeout + REPLY_GRACE_SECONDS

    @property
    def shown_url(self) -> str:
        """The URL for messages and logs: with ``pooler`` back (as SQLAlchemy renders a URL: parameters
        in name order), without the password."""
        if self.pooler is None or isinstance(self.url, ServiceURL):
            return redact(self.url)
        return redact(self.url.update_query_dict({"pooler": self.pooler}))

    @property
    def database_url(self) -> URL:
        """The URL, for a store that talks to the database itself (not to a service)."""
        if isinstance(self.url, ServiceURL):
            raise ConfigurationError(f"{self.shown_url} is a service's URL, not a database's", field="url")
        return self.url

    @classmethod
    def build(
        cls,
        url: str | URL | ServiceURL | None,
        *,
        owner: str | None,
        ttl: float | None,
        lock_wait_timeout: float,
        retries: int,
        auto_upgrade: bool | None,
        token: str | None = None,
        pool_size: int | None = None,
        reply_timeout: float | None = None,
        max_ttl: float | None = None,
    ) -> Settings:
        parsed = parse_url(url)
        pooler: Pooler | None = None
        if isinstance(parsed, ServiceURL):
            if parsed.has_parameter("pooler"):
                raise _pooler_misplaced(parsed.get_backend_name())
        else:
            parsed, pooler = _take_pooler(parsed)
            _check_database_url(parsed)
        wait = _validate.timeout(lock_wait_timeout, "lock_wait_timeout")
        if wait is None or wait <= 0:
            raise InvalidArgument("lock_wait_timeout must be a positive number of seconds", field="lock_wait_timeout")
        replies = _validate.reply_timeout(reply_timeout, wait)
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
            raise InvalidArgument("retries must be a whole number from 0 to 100", field="retries")
        return cls(
            url=parsed,
            owner=_validate.owner(owner if owner is not None else default_owner()),
            ttl_ms=_validate.ttl_ms(DEFAULT_TTL if ttl is None else ttl),
            ttl_chosen=ttl is not None,
            lock_wait_timeout=wait,
            retries=retries,
            auto_upgrade=(
                parsed.get_backend_name() == "sqlite"
                if auto_upgrade is None
                else _validate.flag(auto_upgrade, "auto_upgrade")
            ),
            token=_token(token),
            pooler=pooler,
            pool_size=pool_size,
            chosen_reply_timeout=replies,
            max_ttl_ms=None if max_ttl is None else _validate.ttl_ms(max_ttl),
        )


def _check_database_url(url: URL) -> None:
    if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
        # Each connection of the pool would have a database of its own, and the client's threads (its
        # listener, a watchdog, the caller's) would each see other permits, or no tables at all.
        raise ConfigurationError(
            "an in-memory SQLite database is private to one connection, and permits uses several: give a"
            " file (sqlite:///permits.db; a temporary one for tests)",
            field="url",
        )
    charset = url.query.get("charset")
    if url.get_backend_name() in ("mysql", "mariadb") and charset not in (None, "utf8mb4"):
        # Names, keys, owners and reasons are Unicode: another character set cannot hold them all.
        raise ConfigurationError(f"permits needs charset=utf8mb4 on MariaDB/MySQL, not {charset}", field="url")


def _pooler_misplaced(backend: str) -> ConfigurationError:
    return ConfigurationError(
        "the URL parameter pooler= applies to PostgreSQL URLs only", field="pooler", backend=backend
    )


def _take_pooler(url: URL) -> tuple[URL, Pooler | None]:
    """The URL without permits' own ``pooler`` parameter, which the driver would refuse, and its value."""
    value = url.query.get("pooler")
    if value is None:
        return url, None
    if url.get_backend_name() != "postgresql":
        raise _pooler_misplaced(url.get_backend_name())
    if value == "statement":
        raise ConfigurationError(
            "pooler=statement cannot work: a statement pooler refuses transactions of several statements,"
            " which permits needs (a multi-semaphore acquire, a sweep); use a session or transaction pool",
            field="pooler",
        )
    if not isinstance(value, str) or value not in POOLERS:
        raise ConfigurationError(
            f"pooler= must be one of {', '.join(POOLERS)} (how the pooler in front of PostgreSQL hands out"
            f" server connections), not {value!r}",
            field="pooler",
        )
    return url.difference_update_query(["pooler"]), value


def _token(token: str | None) -> str | None:
    if token is None:
        return os.environ.get("PERMITS_TOKEN") or None
    if not isinstance(token, str) or not token or any(c.isspace() for c in token) or not token.isprintable():
        raise ConfigurationError("a service token must be a non-empty string without spaces", field="token")
    return token
