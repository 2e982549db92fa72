"""Single sign-on against a real OpenID provider process (tests/sso_support.py): the
configuration API, the web UI's round trip, and the sign-in landing as the person."""

from __future__ import annotations

import html
import re
import secrets
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.app.sso_flows import challenge_of
from services.root.bootstrap import Plane
from tests.api_support import ADMIN_TOKEN
from tests.sso_support import (
    LOOPBACK,
    Idp,
    Sso,
    consent_token,
    idp_fixture,  # noqa: F401  # the fixture
    query_of,
    sso_fixture,  # noqa: F401  # the fixture
)


async def test_a_person_signs_in_to_the_web_ui_through_the_provider(sso: Sso, idp: Idp) -> None:
    await sso.configure("acme", idp, display_name="Acme IdP", allowed_domains=["acme.test"])
    await idp.user("alice", email="alice@acme.test", name="Alice", groups=["net-admins"])
    browser = sso.browser()
    status, page = (await browser.get("/?org=acme"))[0::2]
    assert status == 200 and "Sign in with Acme IdP" in page
    status, location = await browser.sign_in(idp, "acme", "alice")
    assert (status, location) == (303, "/orgs/acme"), location
    status, _, page = await browser.get("/orgs/acme")
    assert status == 200 and "alice@acme.test" in page


async def test_a_sign_in_begun_on_one_replica_finishes_on_another(
    sso: Sso, idp: Idp, system: Plane, tmp_path: Path
) -> None:
    """The flow lives in NATS (read at the leader), not in the replica that began it."""
    await sso.configure("acme", idp)
    await idp.user("alice", email="alice@acme.test")
    async with system.projector(tmp_path / "rm2.sqlite") as projector:
        other = system.web_app(
            projector, admin_token=ADMIN_TOKEN, repositories=None, sso_allow=LOOPBACK
        )
        async with TestClient(TestServer(other)) as client2:
            browser = sso.browser()
            back = await idp.authorize(await browser.begin("acme"), "alice")
            parts = urlsplit(back)
            elsewhere = str(client2.make_url(f"{parts.path}?{parts.query}"))
            status, location, page = await browser.get(elsewhere)
            assert (status, location) == (303, "/orgs/acme"), page
            status, _, page = await browser.get(str(client2.make_url("/orgs/acme")))
            assert status == 200 and "alice@acme.test" in page
            assert (await browser.get(elsewhere))[0] == 400  # and once only, anywhere


@pytest.mark.parametrize("client_id", ["terraform-cli", "runplane-cli"])
async def test_terraform_login_offers_single_sign_on(sso: Sso, idp: Idp, client_id: str) -> None:
    """login.v1's consent page, reached without a session, signs in with the provider and
    comes back to ask; the token it gives is the signed-in person's."""
    await sso.configure("acme", idp)
    await idp.user("alice", email="alice@acme.test")
    verifier = secrets.token_urlsafe(48)
    query = {
        "client_id": client_id,
        "response_type": "code",
        "redirect_uri": "http://localhost:10003/login",
        "code_challenge": challenge_of(verifier),
        "code_challenge_method": "S256",
        "state": "st4te",
    }
    consent = "/app/oauth/authorize?" + urlencode(query)
    browser = sso.browser()
    status, _, page = await browser.get(consent)
    assert status == 401 and "Sign in with single sign-on" in page
    next_path = html.unescape(re.findall(r"name='next' value='([^']*)'", page)[0])
    status, back = await browser.sign_in(idp, "acme", "alice", next_path)
    assert status == 303 and urlsplit(back).path == "/app/oauth/authorize", back
    assert query_of(back) == query  # back to the consent it came from
    status, _, page = await browser.get(back)
    assert status == 200 and "alice@acme.test" in page, page
    token = await consent_token(browser, page, query, verifier)
    who = await sso.http.get("/api/v1/whoami", token=token)
    assert who.status == 200 and who.body["user"] == "alice@acme.test", who.body


def test_the_callback_follows_the_public_url_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--public-url` (not only RUNPLANE_PUBLIC_URL) is the base of the URL the provider
    sends the browser back to: behind a proxy, the request's own host is an inside name."""
    from aiohttp.test_utils import make_mocked_request

    from services.root import cli
    from services.surfaces.ui.sso import callback_url

    monkeypatch.setenv("RUNPLANE_PUBLIC_URL", "")  # unset, and put back as it was after
    request = make_mocked_request("GET", "/app/sso/start", headers={"Host": "inside:8080"})
    assert callback_url(request) == "http://inside:8080/app/sso/callback"
    ns = cli.parser().parse_args(["api", "--public-url", "https://runplane.example.com/"])
    assert cli.options(ns).public_url
    assert callback_url(request) == "https://runplane.example.com/app/sso/callback"
