"""A real OpenID provider for the single sign-on tests, and a browser that signs in with it.

The provider is `oidc-provider-mock` (PyPI; Flask and Authlib), started as a process of
its own on port 0 (`python -m oidc_provider_mock`): real discovery, a real RSA key and
JWKS, real authorization codes and RS256 ID tokens carrying the nonce it was sent. Its
users are set over its HTTP API (`PUT /users/<sub>` with their claims), and a person
"signs in" by posting its authorization form (the `sub` to authorize). A restart on the
same port is a provider that rotated its signing key (a new one per process). Holds no
tests itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from services.root.bootstrap import Plane
from services.surfaces.api.context import API
from tests.api_support import Http, served

_LISTENING = re.compile(rb"Uvicorn running on http://127\.0\.0\.1:(\d+)")
LOOPBACK = frozenset({"loopback"})


class Idp:
    """One oidc-provider-mock process; `issuer` is its URL."""

    def __init__(self, log: Path, *, token_max_age: int = 3600) -> None:
        self.log = log
        self.token_max_age = token_max_age
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def issuer(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Idp:
        args = [sys.executable, "-m", "oidc_provider_mock", "--port", str(self.port)]
        args += ["--token-max-age", str(self.token_max_age), "--require-nonce"]
        with self.log.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *args, stdout=out, stderr=out, start_new_session=True
            )
        self.log.touch()
        seen = self.log.stat().st_size  # a restart's log follows the last life's
        for _ in range(300):
            found = _LISTENING.findall(self.log.read_bytes()[seen:])
            if found and (self.port == 0 or int(found[-1]) == self.port):
                self.port = int(found[-1])
                if self.proc.returncode is None:
                    return self
            if self.proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
        raise AssertionError(f"the provider did not start: {self.log.read_text()[-2000:]}")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        self.proc = None

    async def restart(self) -> None:
        """The same issuer with a new signing key (the provider makes one per process)."""
        await self.stop()
        await self.start()

    async def user(self, sub: str, **claims: Any) -> None:
        async with aiohttp.ClientSession() as s:
            async with s.put(f"{self.issuer}/users/{sub}", json=claims) as r:
                assert r.status == 204, await r.text()

    async def authorize(self, url: str, sub: str) -> str:
        """The person `sub` allows the authorization request `url`: where the provider
        sends the browser back (the callback with `code` and `state`)."""
        assert url.startswith(self.issuer + "/"), url
        async with aiohttp.ClientSession() as s:
            async with s.post(url, data={"sub": sub}, allow_redirects=False) as r:
                assert r.status == 302, (r.status, await r.text())
                return r.headers["Location"]


@contextlib.asynccontextmanager
async def idp_process(tmp_path: Path, name: str = "idp", **kw: Any) -> AsyncIterator[Idp]:
    idp = Idp(tmp_path / f"{name}.log", **kw)
    await idp.start()
    try:
        yield idp
    finally:
        await idp.stop()


@pytest.fixture(name="idp")
async def idp_fixture(tmp_path: Path) -> AsyncIterator[Idp]:
    """A provider process of its own for the test."""
    async with idp_process(tmp_path) as found:
        yield found


class Browser:
    """A browser: its own cookies, redirects followed only where told."""

    def __init__(self, client: TestClient[Any, Any]) -> None:
        self.client = client
        self.session = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))

    def url(self, path: str) -> str:
        return path if path.startswith("http") else str(self.client.make_url(path))

    async def get(self, path: str, *, follow: bool = False) -> tuple[int, str, str]:
        """(status, Location, body) of a GET."""
        async with self.session.get(self.url(path), allow_redirects=follow) as r:
            return r.status, r.headers.get("Location", ""), await r.text()

    async def begin(self, org: str, next_path: str = "") -> str:
        """Start single sign-on for `org`: the provider's authorization URL."""
        query = {"org": org, **({"next": next_path} if next_path else {})}
        async with self.session.get(
            self.url("/app/sso/start"), params=query, allow_redirects=False
        ) as r:
            assert r.status == 303, (r.status, await r.text())
            return r.headers["Location"]

    async def sign_in(self, idp: Idp, org: str, sub: str, next_path: str = "") -> tuple[int, str]:
        """The whole round trip: (status, Location) of the callback."""
        back = await idp.authorize(await self.begin(org, next_path), sub)
        status, location, _ = await self.get(back)
        return status, location

    def cookie(self, name: str) -> str | None:
        return next((c.value for c in self.session.cookie_jar if c.key == name), None)

    async def close(self) -> None:
        await self.session.close()


class Sso:
    """The API with the encryption key (single sign-on needs it) and browsers on it."""

    def __init__(self, http: Http, web_app: web.Application, client: TestClient[Any, Any]):
        self.http = http
        self.web_app = web_app
        self.client = client
        self.browsers: list[Browser] = []

    def browser(self) -> Browser:
        b = Browser(self.client)
        self.browsers.append(b)
        return b

    async def configure(self, org: str, idp: Idp, **fields: Any) -> dict[str, Any]:
        body = {
            "issuer": idp.issuer,
            "client_id": f"runplane-{org}",
            "client_secret": f"secret-of-{org}",
            **fields,
        }
        a = await self.http.call("PUT", f"/api/v1/orgs/{org}/sso", json=body)
        assert a.status == 200, a.body
        return a.body  # type: ignore[no-any-return]  # JSON object


@contextlib.asynccontextmanager
async def sso_api(
    system: Plane, db: Path, *, sso_allow: frozenset[str] = LOOPBACK, **knobs: Any
) -> AsyncIterator[Sso]:
    """The API over `system` (its key ring) with loopback providers allowed (unless told
    otherwise); `acme` and `beta` exist."""
    async with served(system, db, "acme", sso_allow=sso_allow, **knobs) as (web_app, client):
        http = Http(client, web_app[API], system.app)
        assert (await http.post("/api/v1/orgs", json={"name": "beta"})).status == 201
        sso = Sso(http, web_app, client)
        try:
            yield sso
        finally:
            for b in sso.browsers:
                await b.close()


@pytest.fixture(name="sso")
async def sso_fixture(system: Plane, tmp_path: Path) -> AsyncIterator[Sso]:
    async with sso_api(system, tmp_path / "rm.sqlite") as found:
        yield found


def query_of(location: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(location).query).items()}


async def consent_token(browser: Browser, page: str, query: dict[str, str], verifier: str) -> str:
    """The consent page `page` (asked with `query`) allowed, and its code exchanged at
    the token endpoint with the PKCE `verifier`: the access token."""
    fields = {k: html.unescape(v) for k, v in re.findall(r"name='([^']+)' value='([^']*)'", page)}
    async with browser.session.post(
        browser.url("/app/oauth/authorize"),
        data={**fields, "decision": "allow"},
        allow_redirects=False,
    ) as r:
        assert r.status == 303, await r.text()
        code = query_of(r.headers["Location"])["code"]
    form = {
        "grant_type": "authorization_code",
        "code": code,
        "code_verifier": verifier,
        "client_id": query["client_id"],
        "redirect_uri": query["redirect_uri"],
    }
    async with browser.session.post(browser.url("/app/oauth/token"), data=form) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["access_token"])


async def id_token(idp: Idp, client_id: str, sub: str, *, nonce: str = "n0nce") -> str:
    """An ID token the provider issues to `client_id` for `sub`, as any client of it (an
    attacker's too) can obtain one: authorization, then the code at the token endpoint."""
    redirect = "http://127.0.0.1:9/cb"
    query = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": redirect,
        "scope": "openid email profile",
        "state": "s",
        "nonce": nonce,
    }
    url = f"{idp.issuer}/oauth2/authorize?{urlencode(query)}"
    code = query_of(await idp.authorize(url, sub))["code"]
    form = {"grant_type": "authorization_code", "code": code, "redirect_uri": redirect}
    async with aiohttp.ClientSession() as s:
        auth = {"Authorization": aiohttp.encode_basic_auth(client_id, "any")}
        async with s.post(f"{idp.issuer}/oauth2/token", data=form, headers=auth) as r:
            assert r.status == 200, await r.text()
            return str((await r.json())["id_token"])


async def org_tokens(sso: Sso, org: str) -> int:
    """How many tokens `org` has issued (a sign-in issues one: refused ones none)."""
    a = await sso.http.get(f"/api/v1/orgs/{org}/tokens")
    assert a.status == 200, a.body
    return len(a.body["items"])
