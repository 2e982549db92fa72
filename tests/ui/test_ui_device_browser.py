"""`runplane login --device` with a real headless Chromium as the person's browser: the
CLI process prints its line; Chromium opens the complete verification URI without a
session, clicks "Sign in with ...", authorizes at the real provider's own form
(oidc-provider-mock) as a person acme has never seen, comes back to `/device` with the
code, sees the request (organization, client, who, when, from where) and clicks Approve;
the CLI ends 0 with that person's token. The page has no serious accessibility
violation (axe-core). The time from the click on Approve to the CLI's exit is written
to $RUNPLANE_UI_ARTIFACTS/device-login.json."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By

from tests.cli_client_support import Cli
from tests.device_support import Device, device_fixture, nora  # noqa: F401
from tests.sso_support import Idp, idp_fixture  # noqa: F401
from tests.ui.chrome import ARTIFACTS, Chrome, chrome_fixture  # noqa: F401

pytestmark = [pytest.mark.browser]

_LINE = re.compile(r"^Open \S+ and enter ([A-Z]{4}-[A-Z]{4}) \(or open (\S+)\)$")


async def test_a_person_approves_the_cli_in_chromium_after_signing_in_by_sso(
    chrome: Chrome, device: Device, idp: Idp, tmp_path: Path
) -> None:
    await nora(device.sso, idp)
    await chrome.call(chrome.driver.delete_all_cookies)
    blocked = {"urls": ["*cdn.jsdelivr.net*"]}  # the provider's CSS: no DNS wait offline
    await chrome.call(lambda: chrome.driver.execute_cdp_cmd("Network.enable", {}))
    await chrome.call(lambda: chrome.driver.execute_cdp_cmd("Network.setBlockedURLs", blocked))
    cli = Cli(tmp_path / "home")
    proc = await cli.start("login", device.base, "--device", "--org", "acme")
    assert proc.stderr is not None
    line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode().rstrip("\n")
    found = _LINE.match(line)
    assert found, line
    code, complete = found.groups()

    await chrome.open(complete)
    link = await chrome.css("#sso")
    await chrome.call(link.click)
    field = await chrome.until(lambda d: d.find_element(By.NAME, "sub"), "the provider's form")
    await chrome.call(lambda: field.send_keys("nora\n"))
    await chrome.until(lambda d: d.find_elements(By.ID, "device-confirm"), "the request")
    assert await chrome.text("#device-code") == code
    assert await chrome.text("#device-org") == "acme"
    assert "runplane's CLI" in await chrome.text("#device-client")
    assert await chrome.text("#device-user") == "nora@acme.test"
    assert await chrome.text("#device-asked-from") == "127.0.0.1"
    await chrome.shot("device-01-confirm")
    violations = await chrome.axe()
    assert not violations, [(v["id"], v["help"], len(v["nodes"])) for v in violations]

    started = time.perf_counter()
    approve = await chrome.css("#device-approve")
    await chrome.call(approve.click)
    await chrome.until(lambda d: d.find_elements(By.ID, "device-done"), "approved")
    assert "Approved" in await chrome.text("#device-done")
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    elapsed = time.perf_counter() - started
    assert proc.returncode == 0 and "nora@acme.test" in out.decode(), (out, err)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "device-login.json").write_text(
        json.dumps({"approve_to_cli_exit_s": round(elapsed, 3), "interval_s": 1.0})
    )
    print(f"approve click to the CLI's exit: {elapsed:.2f} s (interval 1 s)")
