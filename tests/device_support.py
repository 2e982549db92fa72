"""The device flow's tests' kit (`runplane login --device`, RFC 8628): the API with single
sign-on (tests/sso_support.py) and grants on a clock the test moves, a device that asks
and polls over HTTP, and a browser that enters the code and approves. Holds no tests."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from services.app.device import DeviceGrants
from services.root.bootstrap import Plane
from tests.sso_support import Browser, Idp, Sso, sso_api

GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"
V1 = "/api/v1/orgs"


class Clock:
    """time.time(), moved forward by the test (a grant's expiry without waiting), or
    stopped (`freeze`: only the test moves it, so a loaded machine's pause between two
    requests is not a poll in time)."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.frozen: float | None = None

    def freeze(self) -> None:
        self.frozen = time.time()

    def __call__(self) -> float:
        return (time.time() if self.frozen is None else self.frozen) + self.offset


class Hidden(HTMLParser):
    """A page's hidden form fields."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "input" and a.get("type") == "hidden" and a.get("name"):
            self.fields[str(a["name"])] = a.get("value") or ""


def hidden(page: str) -> dict[str, str]:
    parser = Hidden()
    parser.feed(page)
    return parser.fields


@dataclass
class Device:
    """The API (`sso`), its grants (`grants`, interval 1 s) and their clock."""

    sso: Sso
    grants: DeviceGrants
    clock: Clock

    @property
    def base(self) -> str:
        return str(self.sso.client.make_url("")).rstrip("/")

    async def ask(self, org: str = "acme", **fields: str) -> tuple[int, dict[str, Any]]:
        """POST /oauth/device/code as a form: (status, JSON)."""
        form = {"organization": org, **fields}
        r = await self.sso.client.post("/oauth/device/code", data=form)
        return r.status, await r.json(content_type=None)

    async def code(self, org: str = "acme", **fields: str) -> dict[str, Any]:
        status, answer = await self.ask(org, **fields)
        assert status == 200, answer
        return answer

    async def poll(
        self, device_code: str, client_id: str = "runplane-cli"
    ) -> tuple[int, dict[str, Any]]:
        """POST /oauth/device/token: (status, JSON)."""
        form = {"grant_type": GRANT_TYPE, "device_code": device_code, "client_id": client_id}
        r = await self.sso.client.post("/oauth/device/token", data=form)
        return r.status, await r.json(content_type=None)

    async def signed_in(
        self, idp: Idp, sub: str, org: str = "acme", user_code: str = ""
    ) -> Browser:
        """A browser signed in by single sign-on as `sub`, coming back to /device."""
        browser = self.sso.browser()
        back = "/device" + (f"?{urlencode({'user_code': user_code})}" if user_code else "")
        status, location = await browser.sign_in(idp, org, sub, back)
        assert status == 303 and location == back, (status, location)
        return browser

    async def decide(
        self, browser: Browser, user_code: str, decision: str = "approve", **changes: str
    ) -> tuple[int, str]:
        """The confirmation page of `user_code`, then its button `decision`; `changes`
        to the posted fields (a missing CSRF token, another code)."""
        status, _, page = await browser.get(f"/device?{urlencode({'user_code': user_code})}")
        assert status == 200 and "device-confirm" in page, (status, page)
        fields = {**hidden(page), "decision": decision, **changes}
        fields = {k: v for k, v in fields.items() if v != "-"}
        origin = browser.url("/").rstrip("/")
        async with browser.session.post(
            browser.url("/device/decide"), data=fields, headers={"Origin": origin}
        ) as r:
            return r.status, await r.text()


async def nora(sso: Sso, idp: Idp, *, team_level: str = "plan") -> None:
    """acme: workspace net, team network (`team_level` on net) from group net-eng; the
    provider's users nora (acme) and bob (beta); single sign-on on both."""
    await sso.http.workspace("acme", "net")
    await sso.http.workspace("beta", "net")
    team = {"name": "network", "idp_groups": ["net-eng"]}
    assert (await sso.http.post(f"{V1}/acme/teams", json=team)).status == 201
    grant = {"team": "network", "level": team_level}
    put = await sso.http.call("PUT", f"{V1}/acme/workspaces/net/access", json=grant)
    assert put.status == 200, put.body
    await sso.configure("acme", idp)
    await sso.configure("beta", idp)
    await idp.user("nora", email="nora@acme.test", groups=["net-eng"])
    await idp.user("bob", email="bob@beta.test", groups=[])


@pytest.fixture(name="device")
async def device_fixture(system: Plane, tmp_path: Path) -> AsyncIterator[Device]:
    clock = Clock()
    grants = DeviceGrants(system.nc, now=clock, interval=1.0)
    async with sso_api(system, tmp_path / "rm.sqlite", device_grants=grants) as sso:
        yield Device(sso=sso, grants=grants, clock=clock)
