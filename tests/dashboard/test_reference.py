"""The API reference pages (``/docs``, ``/redoc``) in a real browser with no way out of the machine: every
request to another host is refused, as on a private network, and the pages must still draw the API
(they loaded Swagger UI and ReDoc from jsDelivr, and were blank there)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests._service import Service, running
from tests.dashboard._browser import needs_chromium

REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
TOKENS = [{"name": "ops", "token": "reference-admin-token-0123456789", "admin": True}]

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = needs_chromium


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    # With tokens: the pages and their assets need none, as /openapi.json does not.
    with running(f"sqlite:///{tmp_path_factory.mktemp('reference') / 'permits.db'}", tokens=TOKENS) as svc:
        yield svc


def _offline_page(browser: Any, service: Service) -> tuple[Any, list[str], list[str]]:
    """A page whose requests to any host but the service's are refused; and what it asked elsewhere, and
    the errors it logged."""
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    own = urlsplit(service.url).netloc
    elsewhere: list[str] = []
    errors: list[str] = []
    page.route("**/*", lambda route: _route(route, own, elsewhere))
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    return page, elsewhere, errors


def _route(route: Any, own: str, elsewhere: list[str]) -> None:
    url = route.request.url
    if urlsplit(url).netloc == own or url.startswith("data:"):
        route.continue_()
    else:
        elsewhere.append(url)
        route.abort()


def test_swagger_ui_draws_the_api_without_leaving_the_machine(browser: Any, service: Service) -> None:
    page, elsewhere, errors = _offline_page(browser, service)
    page.goto(service.url + "/docs")
    # An operation of the API, drawn from /openapi.json by Swagger UI's script.
    sync_api.expect(page.locator(".opblock-summary-path", has_text="/v1/leases/release").first).to_be_visible(
        timeout=20_000
    )
    sync_api.expect(page.locator(".info .title")).to_contain_text("permits")
    page.locator(".opblock-summary-path", has_text="/v1/leases/release").first.click()
    sync_api.expect(page.locator(".opblock-body").first).to_be_visible()
    assert elsewhere == []
    assert errors == []


def test_redoc_draws_the_api_without_leaving_the_machine(browser: Any, service: Service) -> None:
    page, elsewhere, errors = _offline_page(browser, service)
    page.goto(service.url + "/redoc")
    sync_api.expect(page.get_by_text("/v1/leases/release").first).to_be_attached(timeout=20_000)
    sync_api.expect(page.locator("h1").first).to_contain_text("permits")
    # Its own logo, in the side bar's "API docs by Redocly", is on cdn.redoc.ly: the page's policy keeps
    # the browser from asking (and says so in the console); the page is whole without it.
    assert elsewhere == []
    assert [e for e in errors if REDOC_LOGO not in e] == []


def test_the_reference_assets_are_served_with_validators_and_need_no_token(service: Service) -> None:
    with httpx.Client(base_url=service.url, timeout=30) as http:
        for path, kind in (
            ("/docs/assets/swagger-ui-bundle.js", "javascript"),
            ("/docs/assets/swagger-ui.css", "text/css"),
            ("/docs/assets/redoc.standalone.js", "javascript"),
        ):
            first = http.get(path)
            assert first.status_code == 200, (path, first.status_code)
            assert kind in first.headers["content-type"], first.headers
            again = http.get(path, headers={"If-None-Match": first.headers["etag"]})
            assert again.status_code == 304, path  # a browser fetches each once
        missing = http.get("/docs/assets/nothing.js")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found"  # the API's error body, as for any path
        for climbing in ("..%2Fcore.py", "..%2F__init__.py", "%2e%2e%2Fconsts.py"):  # fastapi_offline's own
            assert http.get(f"/docs/assets/{climbing}").status_code == 404, climbing
        refused = http.post("/docs/assets/swagger-ui.css")
        assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD", refused.headers
        for page in ("/docs", "/redoc"):
            html = http.get(page)
            assert html.status_code == 200 and "text/html" in html.headers["content-type"]
            assert "cdn.jsdelivr.net" not in html.text and "fonts.googleapis.com" not in html.text
            assert "default-src 'self'" in html.headers["content-security-policy"]
            assert html.headers["x-content-type-options"] == "nosniff"
