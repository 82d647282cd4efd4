"""The dashboard in a real browser: Debian's Chromium, driven by Playwright, against a real ``permits
serve`` with tokens, under load made through the API. Each page is also photographed: the pictures in
docs/dashboard/ are these tests' screenshots, written there when ``PERMITS_SCREENSHOTS`` is set. Run this
file alone then, in one process, so that each page shows what the tests before it in the file made and
nothing else: ``PERMITS_SCREENSHOTS=1 .venv/bin/python -m pytest tests/dashboard/test_browser.py``. (Spread
over parallel workers, the pictures varied from run to run.) Otherwise they go to a temporary directory,
so that a test run leaves the checkout as it was."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._service import ROOT, Service, running, wait_until
from tests.dashboard._browser import needs_chromium

#: Where the screenshots go when asked for (see above).
DOCS_SHOTS = ROOT / "docs" / "dashboard"
ADMIN, ALICE = "browser-admin-token-0123456789", "browser-alice-token-0123456789"
TOKENS = [{"name": "ops", "token": ADMIN, "admin": True}, {"name": "alice", "token": ALICE}]
FAST = {"PERMITS_DASHBOARD__STEP": "1", "PERMITS_DASHBOARD__POLL_INTERVAL": "0.2"}

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = needs_chromium


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    url = f"sqlite:///{tmp_path_factory.mktemp('browser') / 'permits.db'}"
    with running(url, tokens=TOKENS, env=FAST) as svc:
        yield svc


@pytest.fixture
def api(service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as client:
        yield client


def _open(browser: Any, service: Service, token: str, path: str = "/", **context: Any) -> Any:
    page = browser.new_context(**{"viewport": {"width": 1280, "height": 900}, **context}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.errors = errors
    page.goto(service.url + path)
    page.fill("#token", token)
    page.get_by_role("button", name="Sign in").click()
    sync_api.expect(page.locator("#whoami")).not_to_be_empty()
    return page


def _no_errors(page: Any) -> None:
    # A 401 before signing in is expected; anything else in the console is a bug in the page.
    assert [e for e in page.errors if "401" not in e] == []


def _semaphores(api: httpx.Client, name: str, capacity: int, held: int) -> list[dict[str, Any]]:
    api.post("/v1/semaphores", json={"name": name, "capacity": capacity, "reason": "browser test"})
    return [api.post("/v1/leases", json={"wants": {name: 1}, "ttl": 120}).json() for _ in range(held)]


def test_the_overview_shows_the_right_counts(browser: Any, service: Service, api: httpx.Client, shots: Path) -> None:
    run = uuid.uuid4().hex[:4]
    backups, cron = f"backups-{run}", f"cron-{run}"
    _semaphores(api, backups, 10, 7)
    _semaphores(api, cron, 1, 1)
    assert api.post("/v1/leases", json={"wants": {cron: 1}}).status_code == 409  # a refusal to count
    page = _open(browser, service, ADMIN)
    row = page.locator(f'#semaphores tr[data-name="{backups}"]')
    sync_api.expect(row.locator('[data-col="used"]')).to_have_text("7")
    sync_api.expect(row.locator('[data-col="capacity"]')).to_have_text("10")
    sync_api.expect(row.locator('[data-col="state"]')).to_have_text("ok")
    full = page.locator(f'#semaphores tr[data-name="{cron}"]')
    sync_api.expect(full.locator('[data-col="state"]')).to_have_text("FULL")
    # More than colour: the row says FULL in text, and the bar carries the numbers.
    sync_api.expect(full).to_contain_text("1 / 1")
    # New use shows without a reload.
    api.post("/v1/leases", json={"wants": {backups: 1}, "ttl": 120})
    sync_api.expect(row.locator('[data-col="used"]')).to_have_text("8", timeout=15_000)
    # The filter narrows the table by name.
    page.fill("#filter", cron)
    sync_api.expect(page.locator("#semaphores tbody tr")).to_have_count(1)
    page.fill("#filter", "")
    wait_until(lambda: page.locator(f'tr[data-name="{backups}"] svg title').count() == 1, timeout=10)
    _shot(page, shots, "overview.png")
    _no_errors(page)


def test_the_countdown_moves_and_a_release_disappears_without_a_reload(
    browser: Any, service: Service, api: httpx.Client, shots: Path
) -> None:
    name = f"deploys-{uuid.uuid4().hex[:4]}"
    leases = _semaphores(api, name, 3, 2)
    page = _open(browser, service, ADMIN, f"/#/s/{name}")
    sync_api.expect(page.locator("#semaphore-name")).to_have_text(name)
    token = leases[0]["tokens"][name]
    row = page.locator(f'#holders tr[data-token="{token}"]')
    sync_api.expect(row).to_have_count(1)
    page.evaluate("window.__not_reloaded = true")
    first = _seconds(row.locator('[data-col="expires_in"]').inner_text())
    time.sleep(2.5)
    later = _seconds(row.locator('[data-col="expires_in"]').inner_text())
    assert later < first, (first, later)
    _shot(page, shots, "semaphore.png")
    api.post("/v1/leases/release", json={"key": leases[0]["key"]})
    sync_api.expect(row).to_have_count(0, timeout=10_000)
    assert page.evaluate("window.__not_reloaded") is True
    sync_api.expect(page.locator(f'#holders tr[data-token="{leases[1]["tokens"][name]}"]')).to_have_count(1)
    sync_api.expect(page.locator("#endings")).to_contain_text("released")
    _no_errors(page)


def _seconds(text: str) -> int:
    found = re.match(r"(\d+) s", text)
    assert found, text
    return int(found.group(1))


def test_an_admin_capacity_change_appears_in_the_history(
    browser: Any, service: Service, api: httpx.Client, shots: Path
) -> None:
    name = f"reports-{uuid.uuid4().hex[:4]}"
    _semaphores(api, name, 2, 1)
    page = _open(browser, service, ADMIN, f"/#/s/{name}")
    page.locator("#change-capacity").click()
    dialog = page.locator("#capacity-dialog")
    sync_api.expect(dialog).to_be_visible()
    dialog.locator('input[name="capacity"]').fill("5")
    dialog.locator('textarea[name="reason"]').fill("quarter-end reports")
    _shot(page, shots, "admin.png")
    dialog.get_by_role("button", name="Change capacity").click()
    history = page.locator("#capacity-history")
    sync_api.expect(history).to_contain_text("quarter-end reports", timeout=10_000)
    sync_api.expect(history).to_contain_text("2 → 5")
    sync_api.expect(page.locator("#admin-log")).to_contain_text("set_capacity")
    assert api.get(f"/v1/semaphores/{name}").json()["capacity"] == 5
    _no_errors(page)


def test_an_admin_can_act_with_the_keyboard_alone(browser: Any, service: Service, api: httpx.Client) -> None:
    name = f"keys-{uuid.uuid4().hex[:4]}"
    _semaphores(api, name, 2, 0)
    page = _open(browser, service, ADMIN, f"/#/s/{name}")
    sync_api.expect(page.locator("#change-capacity")).to_be_visible()
    page.locator("#change-capacity").focus()
    page.keyboard.press("Enter")
    sync_api.expect(page.locator("#capacity-dialog")).to_be_visible()
    page.keyboard.press("Escape")  # Esc closes, and focus goes back to the button that opened it
    sync_api.expect(page.locator("#capacity-dialog")).to_be_hidden()
    assert page.evaluate("document.activeElement.id") == "change-capacity"
    page.keyboard.press("Enter")
    page.locator('#capacity-dialog input[name="capacity"]').fill("4")
    page.keyboard.press("Tab")
    page.keyboard.type("typed, not clicked")
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")
    # The dialog closes once the change is made; if it stays open, say what it shows and where the focus
    # went, so that a failure on a loaded machine explains itself.
    try:
        sync_api.expect(page.locator("#capacity-dialog")).to_be_hidden(timeout=20_000)
    except AssertionError as exc:
        shown = page.locator("#capacity-dialog .dlg-error").text_content()
        focus = page.evaluate("document.activeElement.outerHTML")[:200]
        raise AssertionError(f"the capacity dialog stayed open, showing {shown!r}; focus on {focus}") from exc
    sync_api.expect(page.locator("#capacity-history")).to_contain_text("typed, not clicked", timeout=20_000)


def test_a_dialog_closed_and_opened_again_at_once_keeps_what_it_acts_on(
    browser: Any, service: Service, api: httpx.Client
) -> None:
    """A dialog's close event is queued. Closed and opened again within one task (Esc, then Enter on its
    button, on a busy machine), the late close event used to wipe the new opening's context, and the
    change then failed with a script error. Here both happen in one task, so the race is certain."""
    name = f"reopen-{uuid.uuid4().hex[:4]}"
    _semaphores(api, name, 2, 0)
    page = _open(browser, service, ADMIN, f"/#/s/{name}")
    sync_api.expect(page.locator('[data-fact="capacity"]')).to_have_text("2")
    page.locator("#change-capacity").click()
    sync_api.expect(page.locator("#capacity-dialog")).to_be_visible()
    page.evaluate(
        "document.getElementById('capacity-dialog').close(); document.getElementById('change-capacity').click()"
    )
    sync_api.expect(page.locator("#capacity-dialog")).to_be_visible()
    page.locator('#capacity-dialog input[name="capacity"]').fill("5")
    page.locator("#capacity-dialog textarea").fill("reopened at once")
    page.locator('#capacity-dialog button[type="submit"]').click()
    sync_api.expect(page.locator("#capacity-dialog")).to_be_hidden()
    sync_api.expect(page.locator("#capacity-history")).to_contain_text("reopened at once")
    assert api.get(f"/v1/semaphores/{name}").json()["capacity"] == 5
    _no_errors(page)


def test_the_buttons_stay_put_when_the_semaphore_arrives(browser: Any, service: Service, api: httpx.Client) -> None:
    """The facts above the admin buttons used to be drawn only when the semaphore's answer came, which
    moved the buttons down under the pointer: on a loaded machine a click meant for "Edit capacity" hit
    nothing. Here the answer is held back until the buttons have been measured."""
    name = f"still-{uuid.uuid4().hex[:4]}"
    _semaphores(api, name, 2, 0)
    held: list[Any] = []
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    page.route(f"**/v1/semaphores/{name}", lambda route: held.append(route))
    page.goto(service.url + f"/#/s/{name}")
    page.fill("#token", ADMIN)
    page.get_by_role("button", name="Sign in").click()
    button = page.locator("#change-capacity")
    sync_api.expect(button).to_be_visible()
    for _ in range(400):  # Playwright calls the route's handler only while the test waits on the page
        if held:
            break
        page.wait_for_timeout(50)
    before = button.bounding_box()
    held.pop().continue_()
    sync_api.expect(page.locator('[data-fact="capacity"]')).to_have_text("2")
    assert button.bounding_box() == before


def test_a_client_token_sees_no_admin_actions(browser: Any, service: Service, api: httpx.Client) -> None:
    name = f"shared-{uuid.uuid4().hex[:4]}"
    _semaphores(api, name, 2, 1)  # held by the admin identity: alice must not see its key
    page = _open(browser, service, ALICE, f"/#/s/{name}")
    sync_api.expect(page.locator("#whoami")).to_contain_text("read-only")
    sync_api.expect(page.locator("#holders tbody tr")).to_have_count(1)
    sync_api.expect(page.locator("#holders")).to_contain_text("hidden")
    for control in ("#change-capacity", "#delete-semaphore", ".force-release"):
        assert page.locator(control).count() == 0, control
    page.goto(service.url + "/#/")
    sync_api.expect(page.locator("#semaphores")).to_be_visible()
    assert page.locator("#create-semaphore").count() == 0
    # And the API refuses what the page does not offer.
    forbidden = httpx.patch(
        f"{service.url}/v1/semaphores/{name}",
        json={"capacity": 9, "reason": "sneaky"},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert forbidden.status_code == 403
    _no_errors(page)


def test_the_token_is_entered_once(browser: Any, service: Service) -> None:
    context = browser.new_context()
    page = context.new_page()
    page.goto(service.url + "/")
    page.fill("#token", ALICE)
    page.check("#remember")
    page.get_by_role("button", name="Sign in").click()
    sync_api.expect(page.locator("#whoami")).to_contain_text("alice")
    # Another tab of the same browser does not ask again; signing out there forgets it everywhere.
    other = context.new_page()
    other.goto(service.url + "/#/events")
    sync_api.expect(other.locator("#whoami")).to_contain_text("alice")
    assert other.locator("#token-form").is_hidden()
    other.get_by_role("button", name="Sign out").click()
    third = context.new_page()
    third.goto(service.url + "/")
    sync_api.expect(third.locator("#token-form")).to_be_visible()
    context.close()


def test_the_events_page_is_live(browser: Any, service: Service, api: httpx.Client, shots: Path) -> None:
    name = f"events-{uuid.uuid4().hex[:4]}"
    _semaphores(api, name, 2, 0)
    page = _open(browser, service, ADMIN, "/#/events")
    sync_api.expect(page.locator("#live-status")).to_have_text("Live", timeout=10_000)
    lease = api.post("/v1/leases", json={"wants": {name: 1}, "ttl": 60}).json()
    api.post("/v1/leases/release", json={"key": lease["key"]})
    api.patch(f"/v1/semaphores/{name}", json={"capacity": 3, "reason": "events test"})
    events = page.locator("#events")
    sync_api.expect(events.locator('li[data-type="grant"]', has_text=name)).to_have_count(1, timeout=10_000)
    sync_api.expect(events.locator('li[data-type="end"]', has_text=name)).to_have_count(1, timeout=10_000)
    sync_api.expect(events.locator('li[data-type="capacity"]', has_text=name)).to_have_count(1, timeout=10_000)
    _shot(page, shots, "events.png")
    _no_errors(page)


def test_a_phone_sized_screen_needs_no_sideways_scrolling(
    browser: Any, service: Service, api: httpx.Client, shots: Path
) -> None:
    name = f"phone-{uuid.uuid4().hex[:4]}"
    _semaphores(api, name, 4, 4)
    page = _open(browser, service, ALICE, "/", viewport={"width": 390, "height": 844}, is_mobile=True)
    sync_api.expect(page.locator(f'tr[data-name="{name}"]')).to_be_visible()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    _shot(page, shots, "phone.png")


def test_the_page_follows_any_instance(browser: Any, servers: Any, ns: str) -> None:
    """Two instances on one PostgreSQL: the page, served by one, sees what is done through the other."""
    url = servers.url_for("postgresql").render_as_string(hide_password=False)
    with running(url, tokens=TOKENS, env=FAST) as first, running(url, tokens=TOKENS, env=FAST) as second:
        name = f"{ns}fleet"
        headers = {"Authorization": f"Bearer {ADMIN}"}
        with httpx.Client(base_url=second.url, headers=headers, timeout=30) as other:
            lease = _semaphores(other, name, 2, 1)[0]
            page = _open(browser, first, ADMIN, f"/#/s/{name}")
            token = lease["tokens"][name]
            sync_api.expect(page.locator(f'#holders tr[data-token="{token}"]')).to_have_count(1)
            other.post("/v1/leases/release", json={"key": lease["key"]})
            sync_api.expect(page.locator(f'#holders tr[data-token="{token}"]')).to_have_count(0, timeout=10_000)
            other.patch(f"/v1/semaphores/{name}", json={"capacity": 6, "reason": "from the other instance"})
            sync_api.expect(page.locator("#capacity-history")).to_contain_text(
                "from the other instance", timeout=10_000
            )


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return DOCS_SHOTS if os.environ.get("PERMITS_SCREENSHOTS") else tmp_path_factory.mktemp("screenshots")


def _shot(page: Any, shots: Path, name: str) -> None:
    shots.mkdir(parents=True, exist_ok=True)
    page.wait_for_timeout(300)  # let the last fetch paint
    page.screenshot(path=str(shots / name), full_page=True)
    assert (shots / name).stat().st_size > 0
