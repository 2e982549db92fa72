"""`terraform login`'s fallback: discovery without login.v1 (`--terraform-login token`) and
the web UI's `/app/settings/tokens` (services/surfaces/ui/tokens.py), which makes the token the
CLI asks for. The page needs a session of an organization's user, the form its CSRF
token and our origin; the token is the session's user, organization and role, shown
once, never framed. Each test shows the legitimate path working first."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from services.root import cli
from services.surfaces.api.context import API
from services.surfaces.ui.tokens import TOKENS
from tests.api_support import ADMIN_TOKEN, web_app_of
from tests.procs import ROOT
from tests.tfe_login_support import _signin
from tests.tfe_support import Tfe, tfe_fixture

__all__ = ["tfe_fixture"]

HTML = {"Accept": "text/html"}


async def _open(tfe: Tfe, path: str = TOKENS) -> tuple[int, str, dict[str, str]]:
    async with tfe.client.get(path, headers=HTML, allow_redirects=False) as r:
        return r.status, await r.text(), dict(r.headers)


def _csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, page
    return found.group(1)


async def _create(
    tfe: Tfe, fields: dict[str, str], headers: dict[str, str] | None = None, path: str = TOKENS
) -> tuple[int, str, dict[str, str]]:
    async with tfe.client.post(
        path, data=fields, headers={**HTML, **(headers or {})}, allow_redirects=False
    ) as r:
        return r.status, await r.text(), dict(r.headers)


def _token_of(page: str) -> str:
    found = re.search(r'<code id="new-token">([^<]+)</code>', page)
    assert found, page
    return found.group(1)


def _not_framable(headers: dict[str, str]) -> None:
    assert headers["X-Frame-Options"] == "DENY"
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    assert headers["Cache-Control"] == "no-store"


async def _tokens(tfe: Tfe, org: str) -> list[dict[str, Any]]:
    listed = await tfe.get(f"/api/v1/orgs/{org}/tokens")
    assert listed.status == 200, listed.body
    return list(listed.body["items"])


async def test_the_page_makes_a_token_of_the_sessions_user_and_role_shown_once(tfe: Tfe) -> None:
    tokens = await tfe.org("acme")
    await _signin(tfe, tokens["viewer"])
    status, page, headers = await _open(tfe, TOKENS + "?source=terraform-login")
    assert status == 200, page
    assert "viewer-user" in page and "(viewer)" in page and "acme" in page
    assert 'id="new-token"' not in page  # nothing is made by opening the page
    _not_framable(headers)
    status, made, headers = await _create(tfe, {"csrf": _csrf(page)})
    assert status == 200, made
    _not_framable(headers)
    issued = _token_of(made)
    assert issued.startswith("rp_") and issued not in tokens.values()
    who = await tfe.tfe("GET", "/api/v2/account/details", token=issued)
    assert who.status == 200 and who.body["data"]["attributes"]["username"] == "viewer-user"
    roles = [t["role"] for t in await _tokens(tfe, "acme") if t["user"] == "viewer-user"]
    assert roles == ["viewer", "viewer"]  # a viewer's session makes a viewer's token
    refused = await tfe.tfe(
        "POST",
        "/api/v2/organizations/acme/workspaces",
        token=issued,
        json={"data": {"type": "workspaces", "attributes": {"name": "net"}}},
    )
    assert refused.status == 403, refused.body  # and it does no more than a viewer
    status, again, _ = await _open(tfe)
    assert status == 200 and issued not in again  # shown once: not on the page again


async def test_the_form_needs_its_csrf_token_and_our_origin(tfe: Tfe) -> None:
    tokens = await tfe.org("acme")
    await _signin(tfe, tokens["operator"])
    _, page, _ = await _open(tfe)
    csrf = _csrf(page)
    before = len(await _tokens(tfe, "acme"))
    for what, fields, headers in (
        ("no CSRF token", {}, {}),
        ("a forged CSRF token", {"csrf": "forged"}, {}),
        ("another site's post", {"csrf": csrf}, {"Origin": "https://evil.example"}),
        ("a post from another port", {"csrf": csrf}, {"Origin": "http://127.0.0.1:1"}),
    ):
        status, refused, headers = await _create(tfe, fields, headers)
        assert status == 403 and 'id="new-token"' not in refused, what
        _not_framable(headers)
    assert len(await _tokens(tfe, "acme")) == before
    status, made, _ = await _create(tfe, {"csrf": csrf})
    assert status == 200 and _token_of(made)
    assert len(await _tokens(tfe, "acme")) == before + 1


async def test_a_session_of_one_organization_makes_tokens_of_that_one_only(tfe: Tfe) -> None:
    acme = await tfe.org("acme")
    await tfe.org("beta")
    beta_before = await _tokens(tfe, "beta")
    await _signin(tfe, acme["admin"])
    _, page, _ = await _open(tfe, TOKENS + "?org=beta")
    assert "beta" not in page
    status, made, _ = await _create(
        tfe, {"csrf": _csrf(page), "org": "beta"}, path=TOKENS + "?org=beta"
    )
    assert status == 200, made
    issued = _token_of(made)
    assert (await tfe.tfe("GET", "/api/v2/organizations/acme", token=issued)).status == 200
    other = await tfe.tfe("GET", "/api/v2/organizations/beta", token=issued)
    assert other.status == 404, other.body
    assert (await tfe.get("/api/v1/orgs/beta/workspaces", token=issued)).status == 404
    assert await _tokens(tfe, "beta") == beta_before
    async with tfe.client.get("/orgs/beta", headers=HTML) as r:
        assert r.status == 404


async def test_no_session_is_asked_to_sign_in_and_the_admin_token_gets_none(tfe: Tfe) -> None:
    tokens = await tfe.org("acme")
    status, page, headers = await _open(tfe)
    assert status == 401 and "Sign in" in page
    _not_framable(headers)
    status, page, _ = await _create(tfe, {"csrf": "anything"})
    assert status == 403 and 'id="new-token"' not in page
    before = len(await _tokens(tfe, "acme"))
    await _signin(tfe, ADMIN_TOKEN, org="acme")
    status, page, _ = await _open(tfe)
    assert status == 403 and "admin token" in page
    async with tfe.client.get("/orgs/acme", headers=HTML) as r:  # the session's CSRF token
        csrf = _csrf(await r.text())
    status, page, _ = await _create(tfe, {"csrf": csrf})
    assert status == 403 and "admin token" in page and 'id="new-token"' not in page
    assert len(await _tokens(tfe, "acme")) == before
    tfe.client.session.cookie_jar.clear()  # another browser
    await _signin(tfe, tokens["approver"])  # an organization's user of any role may
    _, page, _ = await _open(tfe)
    status, made, _ = await _create(tfe, {"csrf": _csrf(page)})
    assert status == 200 and _token_of(made)


async def test_discovery_leaves_login_v1_out_when_told(tfe: Tfe) -> None:
    default = await tfe.tfe("GET", "/.well-known/terraform.json", token=None)
    assert default.body["login.v1"]["grant_types"] == ["authz_code"]
    api = tfe.client.app[API]
    web_app = web_app_of(tfe.system, api.projector, browser_login=False)
    async with (
        TestClient(TestServer(web_app)) as client,
        client.get("/.well-known/terraform.json") as r,
    ):
        services = await r.json()
    assert "login.v1" not in services
    assert services["tfe.v2"] == services["tfe.v2.1"] == "/api/v2/"


def test_the_setting_is_a_flag_or_the_environment_and_a_bad_value_is_one_line(
    monkeypatch: Any,
) -> None:
    monkeypatch.delenv("RUNPLANE_TERRAFORM_LOGIN", raising=False)
    assert cli.options(cli.parser().parse_args(["api"])).terraform_login == "browser"
    flagged = cli.parser().parse_args(["up", "--terraform-login", "token"])
    assert cli.options(flagged).terraform_login == "token"
    monkeypatch.setenv("RUNPLANE_TERRAFORM_LOGIN", "token")
    assert cli.options(cli.parser().parse_args(["api"])).terraform_login == "token"
    for argv, env in ((["--terraform-login", "both"], "browser"), ([], "both")):
        out = subprocess.run(
            [sys.executable, "-m", "services.root.cli", "api", *argv],
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RUNPLANE_TERRAFORM_LOGIN": env},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        assert "--terraform-login" in out.stderr.strip().splitlines()[-1], out.stderr
