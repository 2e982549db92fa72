"""The web UI in a real headless Chromium over the whole plane (real NATS, real
Terraform): sign in, the run awaiting approval highlighted on every page, tick the
destructive boxes (Approve stays disabled until all are), approve, watch the resource
states and the log arrive without a reload, then cancel a queued run and discard another.
axe-core finds no serious violation on any page; a screenshot of each is kept.

Run alone with `-m browser`; the machine is shared, so it is one test on one browser."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from selenium.common.exceptions import StaleElementReferenceException

from events.run import Status
from tests.plane_support import Plane, commit, plane_fixture  # noqa: F401  # the fixture
from tests.ui.chrome import Chrome, chrome_fixture  # noqa: F401  # the module's browser

pytestmark = [pytest.mark.browser, pytest.mark.terraform]

V1 = "/api/v1/orgs/acme"
KEPT = 'resource "null_resource" "a" {\n  triggers = { v = "%s" }\n}\n'
TWO = KEPT % "1" + 'resource "null_resource" "b" {}\n'
BOTH = ["null_resource.a", "null_resource.b"]
ALL = [str(s) for s in Status]


async def _awaiting(plane: Plane, token: str) -> str:
    a = await plane.http.post(f"{V1}/workspaces/net/runs", json={"type": "apply"}, token=token)
    assert a.status == 201, a.body
    await plane.reaches("net", a.body["id"], "awaiting_approval")
    return str(a.body["id"])


async def _check_page(chrome: Chrome, name: str) -> None:
    """The screenshot, then no serious accessibility violation."""
    await chrome.shot(name)
    violations = await chrome.axe()
    assert not violations, [(v["id"], v["help"], len(v["nodes"])) for v in violations]


async def _click(chrome: Chrome, selector: str) -> None:
    element = await chrome.css(selector)
    await chrome.call(element.click)


async def _type(chrome: Chrome, selector: str, text: str) -> None:
    element = await chrome.css(selector)
    await chrome.call(lambda: element.send_keys(text))


def _status_is(*wanted: str) -> Any:
    def probe(driver: Any) -> bool:
        try:
            found = driver.find_elements("css selector", "#run-status")
            return bool(found) and found[0].text in wanted
        except StaleElementReferenceException:  # swapped by the live feed meanwhile
            return False

    return probe


async def test_review_approve_follow_then_cancel_and_discard_in_chromium(
    chrome: Chrome, plane: Plane, repo: Path
) -> None:
    commit(repo, {"main.tf": TWO}, message="two null resources")
    a = await plane.http.post(f"{V1}/workspaces", json={"name": "net", "repository": str(repo)})
    assert a.status == 201, a.body
    a = await plane.http.call(
        "PATCH", f"{V1}/workspaces/net/settings", json={"confirm_destructive": True}
    )
    assert a.status == 200, a.body
    token = await plane.http.post(f"{V1}/tokens", json={"user": "alice", "role": "approver"})
    await plane.executor("e1")
    first = await _awaiting(plane, token.body["token"])
    await plane.approve(first)
    await plane.reaches("net", first, "applied")
    commit(repo, {"main.tf": KEPT % "2"}, message="replace a, delete b")
    run_id = await _awaiting(plane, token.body["token"])
    base = str(plane.http.client.make_url("")).rstrip("/")

    # Sign in through the form, with the keyboard's Enter.
    await chrome.open(base + "/")
    await _check_page(chrome, "01-signin")
    await _type(chrome, "#token", token.body["token"] + "\n")
    await chrome.until(lambda d: "Organization acme" in d.page_source, "the org page")
    for path, name in (("/orgs/acme", "02-org"), ("/orgs/acme/workspaces/net", "03-workspace")):
        await chrome.open(base + path)
        assert "1 awaiting approval" in await chrome.text("#active-runs")
        assert await chrome.all(f'#active-runs li.awaiting a[href$="{run_id}"]')
        await _check_page(chrome, name)

    # The run: Approve is enabled only once every destructive address is ticked.
    await chrome.open(f"{base}/orgs/acme/runs/{run_id}")
    approve = await chrome.css("#approve")
    assert not await chrome.call(approve.is_enabled)
    await _click(chrome, "#ack-1")
    assert not await chrome.call(approve.is_enabled)
    await _click(chrome, "#ack-2")
    assert await chrome.call(approve.is_enabled)
    await _check_page(chrome, "04-run-awaiting")
    await chrome.call(approve.click)

    # Back on the run page: its states and log come live; the page is never reloaded.
    await chrome.gone(approve, "the approval posted")
    await chrome.until(_status_is(*ALL), "the run page again")
    loaded = await chrome.text("#run-status")
    await chrome.js("window.__same_page = true;")
    assert loaded != "applied", "the apply ended before the page could follow it"
    await chrome.until(_status_is("applied"), "the run applied, live")
    states = await chrome.js(
        "return [...document.querySelectorAll('.rstate')].map(e => e.textContent)"
    )
    assert states == ["done", "done"], states
    await chrome.until(
        lambda d: "Apply complete" in d.find_element("id", "log").text, "the log, live"
    )
    assert await chrome.js("return window.__same_page === true;")
    await _check_page(chrome, "05-run-applied")
    done = await plane.run("net", run_id)
    assert sorted(done.acknowledged) == BOTH

    # A second run awaits approval, a third waits behind it: cancel the third, discard
    # the second, each with a reason.
    commit(repo, {"main.tf": KEPT % "3"}, message="replace a again")
    second = await _awaiting(plane, token.body["token"])
    third = await plane.start("net")
    await chrome.open(f"{base}/orgs/acme/runs/{third}")
    await _type(chrome, "#cancel-reason", "not needed")
    await _click(chrome, "#cancel")
    await chrome.until(_status_is("canceled"), "the third run canceled")
    await chrome.open(f"{base}/orgs/acme/runs/{second}")
    await _type(chrome, "#discard-reason", "not today")
    await _click(chrome, "#discard")
    await chrome.until(_status_is("discarded"), "the second run discarded")
    await _check_page(chrome, "06-run-discarded")
    assert (await plane.run("net", second)).reason == "not today"
    assert str((await plane.run("net", third)).status) == "canceled"
    await chrome.open("about:blank")  # its live streams end with the page
