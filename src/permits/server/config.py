"""The service's settings, with their documented bounds.

Read from a TOML file (``permits serve --config permits.toml``) and from ``PERMITS_*`` environment
variables, which win over the file; nested settings use ``__`` (``PERMITS_LIMITS__MAX_WAIT=30``). Tokens
in the environment are JSON: ``PERMITS_TOKENS='[{"name": "ci", "token": "...", "admin": false}]'``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from permits import _validate
from permits._config import DEFAULT_LOCK_WAIT_TIMEOUT, DEFAULT_RETRIES, DEFAULT_URL
from permits._exceptions import ConfigurationError, InvalidArgument

#: Identities appear in lease owners as ``identity/owner``: no slash, short, printable.
#: The longest identity (a token's name): it prefixes its client's owners, which must fit the owner column.
MAX_IDENTITY_LENGTH = 64
_IDENTITY = re.compile(rf"^[A-Za-z0-9_.@:+-]{{1,{MAX_IDENTITY_LENGTH}}}$")


class TokenEntry(BaseModel):
    """One client identity and its bearer token (or the token's SHA-256, to keep secrets out of files)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the identity: 1-64 of A-Z a-z 0-9 _ . @ : + -")
    token: SecretStr | None = None
    token_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    admin: bool = False

    @model_validator(mode="after")
    def _check(self) -> TokenEntry:
        if not _IDENTITY.match(self.name):
            raise ValueError(f"token name {self.name!r} must be 1-64 of A-Z a-z 0-9 _ . @ : + -")
        if (self.token is None) == (self.token_sha256 is None):
            raise ValueError(f"token {self.name!r} needs exactly one of token and token_sha256")
        if self.token is not None and len(self.token.get_secret_value()) < 16:
            raise ValueError(f"token {self.name!r} is shorter than 16 characters")
        return self

    def digest(self) -> str:
        if self.token_sha256 is not None:
            return self.token_sha256
        assert self.token is not None
        return hashlib.sha256(self.token.get_secret_value().encode()).hexdigest()


class Limits(BaseModel):
    """Bounds against abuse; each refusal is a 413, 422 or 429 with a message naming the bound."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=65_536, ge=1024, description="largest request body (413)")
    max_wants: int = Field(
        default=_validate.MAX_WANTS, ge=1, le=_validate.MAX_WANTS, description="semaphores per request"
    )
    max_ttl: float = Field(default=_validate.MAX_TTL_SECONDS, gt=0, le=_validate.MAX_TTL_SECONDS, description="seconds")
    max_wait: float = Field(default=60.0, ge=0, le=3600, description="longest wait one request may ask for, seconds")
    max_waiters: int = Field(default=1000, ge=1, description="requests waiting for room at once, per instance (429)")
    max_leases_per_client: int = Field(default=10_000, ge=1, description="held leases per identity (429)")


class LivenessCheck(BaseModel):
    """Ask ``url`` whether an owner is alive, for owners that start with ``prefix``.

    ``{owner}`` in the URL is replaced by the owner, URL-encoded. A 200 answer means alive, 404 or 410
    means dead (its leases are released with reason ``owner_dead``); anything else, or no answer, means
    unknown, and nothing is released.
    """

    model_config = ConfigDict(extra="forbid")

    prefix: str
    url: str


class Maintenance(BaseModel):
    """Background jobs. Each runs on one instance at a time (a permits lease elects it)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    sweep_interval: float = Field(default=5.0, gt=0, description="seconds between sweeps of expired leases")
    sweep_batch: int = Field(default=500, ge=1, le=100_000)
    liveness_interval: float = Field(default=30.0, gt=0)
    liveness: list[LivenessCheck] = Field(default_factory=list)
    max_lease_age: float | None = Field(default=None, gt=0, description="release leases held longer than this (s)")
    staleness_interval: float = Field(default=60.0, gt=0)
    cleanup_interval: float = Field(default=3600.0, gt=0, description="seconds between deletions of old rows")
    keep_ended_leases: float = Field(default=7 * 86400.0, gt=0, description="seconds an ended lease is kept")
    keep_capacity_history: float = Field(default=30 * 86400.0, gt=0, description="seconds history is kept")
    cleanup_batch: int = Field(default=800, ge=1, le=100_000)


class Dashboard(BaseModel):
    """The live page at ``/`` and the history behind its charts (see docs/dashboard.md)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    step: float = Field(default=10.0, ge=1, le=300, description="seconds between samples of every semaphore")
    keep_stats: float = Field(default=7200.0, ge=3600, description="seconds samples are kept (the charts show 1 h)")
    poll_interval: float = Field(default=1.0, gt=0, le=60, description="seconds between reads of the event feed")
    max_streams: int = Field(default=200, ge=1, description="live event streams per instance (429 beyond)")


class ServerConfig(BaseSettings):
    """Everything ``permits serve`` can be told."""

    model_config = SettingsConfigDict(env_prefix="PERMITS_", env_nested_delimiter="__", extra="forbid")

    database_url: str = DEFAULT_URL
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    tokens: list[TokenEntry] = Field(default_factory=list)
    #: queue a semaphore's acquires in memory on this instance, instead of on database connections
    prelock: bool = True
    #: longest time one request waits in the in-memory queue before a 503 (the database is that slow)
    prelock_wait: float = Field(default=10.0, gt=0)
    #: answer acquire and release without the framework's routing (server/hot.py); off, every request goes
    #: through FastAPI, which answers exactly the same, more slowly
    hot_routes: bool = True
    lock_wait_timeout: float = Field(DEFAULT_LOCK_WAIT_TIMEOUT, gt=0)
    #: how long a statement or transaction may wait for its answer before its connection is taken as lost
    #: (more than twice lock_wait_timeout; default: twice lock_wait_timeout plus 10 s)
    reply_timeout: float | None = Field(default=None, gt=0)
    #: database connections this instance keeps open; up to as many again open in a burst, and close after
    db_pool_size: int = Field(default=20, ge=1, le=1000)
    retries: int = Field(DEFAULT_RETRIES, ge=0, le=100)
    #: seconds in-flight requests get to finish at shutdown
    shutdown_grace: float = Field(default=10.0, ge=0)
    #: export each semaphore's capacity and use as labelled gauges, for at most this many semaphores
    metrics_max_semaphores: int = Field(default=1000, ge=0)
    limits: Limits = Limits()
    maintenance: Maintenance = Maintenance()
    dashboard: Dashboard = Dashboard()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment wins over the file (passed as init values), the usual order for deployments.
        return env_settings, init_settings

    @classmethod
    def load(cls, path: Path | None = None, **overrides: Any) -> ServerConfig:
        """Settings from ``path`` (TOML), the environment and ``overrides`` (which win over both)."""
        values: dict[str, Any] = {}
        if path is not None:
            try:
                values = tomllib.loads(path.read_text())
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigurationError(f"cannot read the config file {path}: {exc}") from exc
        try:
            config = cls(**values)
            if overrides:
                config = config.model_copy(update={k: v for k, v in overrides.items() if v is not None})
                cls.model_validate(config.model_dump())
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigurationError(f"bad setting {where}: {first['msg']}", field=where) from None
        names = [t.name for t in config.tokens]
        if len(set(names)) != len(names):
            raise ConfigurationError("two tokens have the same name", field="tokens")
        try:
            _validate.reply_timeout(config.reply_timeout, config.lock_wait_timeout)
        except InvalidArgument as exc:
            raise ConfigurationError(f"bad setting reply_timeout: {exc}", field="reply_timeout") from None
        return config

    @property
    def open_mode(self) -> bool:
        """No tokens: anyone who can connect may do anything, so the service listens on loopback only."""
        return not self.tokens

    def check_bind(self) -> None:
        """Refuse to serve without tokens on anything but a loopback address."""
        if self.open_mode and not is_loopback(self.host):
            raise ConfigurationError(
                f"no tokens are configured, so the service may only listen on loopback, not {self.host!r};"
                " configure tokens (see docs/service.md) or use --host 127.0.0.1",
                field="host",
            )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
