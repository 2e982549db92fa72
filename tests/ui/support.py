"""A browser-like client of the web UI (its own cookie jar, the CSRF token of the last
page it read) over the real API graph. Holds no tests itself."""

from __future__ import annotations

import html
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import BaseTestServer
from yarl import URL

from services.root.bootstrap import Plane
from services.surfaces.api.context import API
from tests.api_support import Http, served

_CSRF = re.compile(r'name="csrf" value="([^"]*)"')


class Page:
    def __init__(self, status: int, text: str, headers: Any, url: str) -> None:
        self.status = status
        self.text = text
        self.headers = headers
        self.url = url

    @property
    def csrf(self) -> str:
        found = _CSRF.search(self.text)
        assert found, self.text[:500]
        return html.unescape(found.group(1))

    def has(self, text: str) -> bool:
        return text in self.text


class Browser:
    """One browser: cookies kept, redirects followed unless told not to."""

    def __init__(self, server: BaseTestServer) -> None:
        self.server = server
        self.session = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))
        self.last: Page | None = None

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    async def get(self, path: str, **kw: Any) -> Page:
        async with self.session.get(self.url(path), **kw) as r:
            self.last = Page(r.status, await r.text(), r.headers, str(r.url))
        return self.last

    async def post(
        self,
        path: str,
        fields: dict[str, Any] | list[tuple[str, str]] | None = None,
        *,
        csrf: str | None = None,
        follow: bool = True,
        headers: dict[str, str] | None = None,
    ) -> Page:
        """Post a form, with the CSRF token of the last page unless `csrf` is given
        ("" sends none)."""
        data = list(fields.items()) if isinstance(fields, dict) else list(fields or [])
        token = self.last.csrf if csrf is None and self.last is not None else csrf
        if token:
            data.append(("csrf", token))
        async with self.session.post(
            self.url(path), data=data, allow_redirects=follow, headers=headers or {}
        ) as r:
            self.last = Page(r.status, await r.text(), r.headers, str(r.url))
        return self.last

    async def signin(self, token: str, org: str = "") -> Page:
        await self.get("/")
        return await self.post("/signin", {"token": token, "org": org})

    def plant(self, name: str, value: str) -> None:
        """Set a cookie for the server, as an attacker's page or a stolen copy would."""
        self.session.cookie_jar.update_cookies({name: value}, response_url=URL(self.url("/")))

    def cookie(self, name: str) -> str | None:
        for c in self.session.cookie_jar:
            if c.key == name:
                return c.value
        return None

    async def close(self) -> None:
        await self.session.close()


class Ui:
    """The API (for setup, with bearer tokens) and browsers on the same server."""

    def __init__(self, http: Http, server: BaseTestServer) -> None:
        self.http = http
        self.server = server
        self.browsers: list[Browser] = []

    def browser(self) -> Browser:
        b = Browser(self.server)
        self.browsers.append(b)
        return b


@pytest.fixture(name="ui")
async def ui_fixture(system: Plane, tmp_path: Path) -> AsyncIterator[Ui]:
    db = tmp_path / "rm.sqlite"
    async with served(system, db, "ui-test-fixture", secret_store=None) as (web_app, client):
        ui = Ui(Http(client, web_app[API], system.app), client.server)
        try:
            yield ui
        finally:
            for b in ui.browsers:
                await b.close()
