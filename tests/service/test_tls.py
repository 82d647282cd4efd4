"""A client of a service behind TLS (terminated in front of it, as docs/deployment.md says), with a private CA:
trusted through SSL_CERT_FILE, and refused at once, with a configuration_error that says what to set, when the
certificate is not trusted or names another host."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

import permits
from tests._service import Service, running
from tests._tls import TLSFront


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    with running(f"sqlite:///{tmp_path / 'service.db'}") as service:
        with permits.connect(service.url) as client:
            client.create_semaphore("jobs", 1)
        yield service


@pytest.fixture
def front(service: Service, ca: trustme.CA) -> Iterator[TLSFront]:
    host, port = service.url.removeprefix("http://").rsplit(":", 1)
    with TLSFront((host, int(port)), ca.issue_cert("127.0.0.1")) as front:
        yield front


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@pytest.fixture(autouse=True)
def no_trust_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)


def test_a_private_ca_named_by_ssl_cert_file_is_trusted(
    service: Service, front: TLSFront, ca_file: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", ca_file)
    with permits.connect(front.url()) as client, client.lease("jobs", ttl=30, timeout=5) as lease:
        assert lease.token == 1 and client.get_semaphore("jobs").used == 1

    async def in_asyncio() -> int:
        async with permits.connect_async(front.url()) as client:
            lease = await client.acquire("jobs", ttl=30, timeout=5)
            await client.release(lease)
            return lease.token

    assert asyncio.run(in_asyncio()) == 2

    # The CLI, as a cron job would run it.
    env = {**os.environ, "PERMITS_DATABASE_URL": front.url(), "SSL_CERT_FILE": ca_file}
    done = subprocess.run(
        [sys.executable, "-m", "permits", "run", "jobs", "--", sys.executable, "-c", "print('ran')"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ran", done.stderr
    with permits.connect(service.url) as plain:
        assert plain.get_semaphore("jobs").last_token == 3 and plain.get_semaphore("jobs").used == 0


def test_an_untrusted_certificate_is_a_configuration_error_at_once(
    service: Service, front: TLSFront, tmp_path: Path
) -> None:
    """Not a StorageUnavailable after retries, nor an acquire that waits out its timeout: the certificate
    will not be trusted on the next try either."""
    client = permits.connect(front.url())
    started = time.monotonic()
    with pytest.raises(permits.ConfigurationError) as refused:
        client.acquire("jobs", ttl=30, timeout=30)
    assert time.monotonic() - started < 10
    assert refused.value.code == "configuration_error" and refused.value.details["field"] == "url"
    assert "SSL_CERT_FILE" in str(refused.value) and "certificate verify failed" not in str(refused.value)
    assert "unable to get local issuer certificate" in str(refused.value)
    client.close()

    env = {**os.environ, "PERMITS_DATABASE_URL": front.url()}
    done = subprocess.run(
        [sys.executable, "-m", "permits", "run", "jobs", "--", "true"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 2 and "permits: configuration_error:" in done.stderr and "SSL_CERT_FILE" in done.stderr
    with permits.connect(service.url) as plain:  # nothing was granted behind the refusal
        assert plain.get_semaphore("jobs").last_token == 0


def test_a_certificate_for_another_host_is_refused_the_same_way(
    front: TLSFront, ca_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CA is trusted, but the certificate names 127.0.0.1 and the client asked for localhost."""
    monkeypatch.setenv("SSL_CERT_FILE", ca_file)

    async def in_asyncio() -> None:
        async with permits.connect_async(front.url("localhost")) as client:
            await client.list_semaphores()

    with pytest.raises(permits.ConfigurationError, match="Hostname mismatch"):
        asyncio.run(in_asyncio())
