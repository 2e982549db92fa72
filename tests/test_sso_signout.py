"""Single sign-on's loose ends (issue 24): signing out ends the sign-in's token on every
replica, and an ID token whose email the provider says it has not verified signs no one
in. Against a real provider process (tests/sso_support.py)."""

from __future__ import annotations

import re
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from events import sso as sso_agg
from events.codec import decode
from services.root.bootstrap import Plane
from services.surfaces.ui.sessions import COOKIE
from services.surfaces.ui.web import SESSIONS
from tests.api_support import ADMIN_TOKEN, Http
from tests.sso_support import (
    LOOPBACK,
    Browser,
    Idp,
    Sso,
    idp_fixture,  # noqa: F401  # the fixture
    org_tokens,
    sso_fixture,  # noqa: F401  # the fixture
)

_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


async def _post(browser: Browser, path: str, page: str, **fields: str) -> tuple[int, str]:
    """Post a form of `page` (its CSRF value) as `browser`: (status, body)."""
    data = {"csrf": _CSRF.findall(page)[0], **fields}
    async with browser.session.post(browser.url(path), data=data, allow_redirects=False) as r:
        return r.status, await r.text()


async def _callback(sso: Sso, idp: Idp, sub: str) -> tuple[int, str]:
    """A browser's whole sign-in as `sub`: the callback's (status, page)."""
    browser = sso.browser()
    status, _, page = await browser.get(await idp.authorize(await browser.begin("acme"), sub))
    return status, page


async def _ui_sign_in(browser: Browser, token: str) -> tuple[int, str]:
    """The token sign-in form of `/`, as a browser would post it."""
    page = (await browser.get("/"))[2]
    return await _post(browser, "/signin", page, token=token)


async def test_signing_out_revokes_the_sign_ins_token_so_no_copy_works_anywhere(
    sso: Sso, idp: Idp, system: Plane, tmp_path: Path
) -> None:
    """Alice signs in with her provider; a thief copies her cookie (and the token the
    session holds). She signs out: the copied cookie opens no page, and the token is 401
    on the API of this replica and of another one, and signs no one in at the UI's token
    form. On main the token stayed valid for the rest of its 12 hours."""
    await sso.configure("acme", idp)
    await idp.user("alice", email="alice@acme.test")
    alice = sso.browser()
    assert (await alice.sign_in(idp, "acme", "alice"))[0] == 303
    cookie = alice.cookie(COOKIE)
    assert cookie is not None
    session = await sso.web_app[SESSIONS].get(cookie)
    assert session is not None
    token = session.token
    assert (await sso.http.get("/api/v1/whoami", token=token)).status == 200
    thief = sso.browser()
    thief.session.cookie_jar.update_cookies({COOKIE: cookie})
    assert (await thief.get("/orgs/acme"))[0] == 200  # the copy works while she is in

    page = (await alice.get("/orgs/acme"))[2]
    assert (await _post(alice, "/signout", page))[0] == 303

    status, location, body = await thief.get("/orgs/acme")
    assert (status, location) == (303, "/") and "alice@acme.test" not in body, (status, body)
    (await sso.http.get("/api/v1/whoami", token=token)).problem("unauthorized", 401)
    async with system.projector(tmp_path / "rm2.sqlite") as projector:
        other = system.web_app(
            projector, admin_token=ADMIN_TOKEN, repositories=None, sso_allow=LOOPBACK
        )
        async with TestClient(TestServer(other)) as client2:
            http2 = Http(client2, sso.http.api, system.app)
            (await http2.get("/api/v1/orgs/acme/workspaces", token=token)).problem(
                "unauthorized", 401
            )
    status, body = await _ui_sign_in(sso.browser(), token)
    assert status == 401 and "revoked" in body, (status, body)
    state = (await sso.http.app.load_org("acme")).state
    assert len(state.owners) == 1 and set(state.owners) <= state.revoked  # by an event


async def test_signing_out_of_a_pasted_token_session_leaves_the_token(sso: Sso) -> None:
    """A token pasted at the sign-in form is the person's own (their CLI may use it):
    signing out ends the browser's session only."""
    made = await sso.http.post("/api/v1/orgs/acme/tokens", json={"user": "ci", "role": "viewer"})
    token = made.body["token"]
    browser = sso.browser()
    assert (await _ui_sign_in(browser, token))[0] == 303
    page = (await browser.get("/orgs/acme"))[2]
    assert (await _post(browser, "/signout", page))[0] == 303
    assert (await browser.get("/orgs/acme"))[0] != 200
    assert (await sso.http.get("/api/v1/whoami", token=token)).status == 200


async def test_an_id_token_whose_email_is_not_verified_signs_no_one_in(sso: Sso, idp: Idp) -> None:
    """`email_verified: false` (a boolean, or the string some providers send) is the
    sign-in error page `sso-email-unverified`, nothing written. A missing claim is taken
    (many providers leave it out), unless the configuration sets `require_email_verified`,
    which then refuses it too."""
    await sso.configure("acme", idp)
    before = await org_tokens(sso, "acme")
    for sub, verified in (("mallory", False), ("trudy", "false")):
        await idp.user(sub, email=f"{sub}@acme.test", email_verified=verified)
        status, page = await _callback(sso, idp, sub)
        assert status == 400 and "(sso-email-unverified)" in page, (sub, status, page)
    assert await org_tokens(sso, "acme") == before
    await idp.user("alice", email="alice@acme.test")  # no email_verified claim
    await idp.user("vera", email="vera@acme.test", email_verified=True)
    assert (await sso.browser().sign_in(idp, "acme", "alice"))[0] == 303
    config = await sso.configure("acme", idp, require_email_verified=True)
    assert config["require_email_verified"] is True
    status, page = await _callback(sso, idp, "alice")
    assert status == 400 and "(sso-email-unverified)" in page, page
    assert (await sso.browser().sign_in(idp, "acme", "vera"))[0] == 303


def test_a_configuration_recorded_before_the_setting_requires_nothing() -> None:
    """`org.sso_configured` as main wrote it decodes with `require_email_verified` off:
    an organization's sign-ins go on as before until its admin turns it on."""
    old = b'{"type":"org.sso_configured","at":"2026-01-01T00:00:00Z","actor":"admin",'
    old += b'"issuer":"https://idp.example.com","client_id":"runplane"}'
    event = decode(old)
    assert isinstance(event, sso_agg.SsoConfigured) and not event.require_email_verified
    assert not sso_agg.fold([event]).require_email_verified
    assert sso_agg.email_unverified({}, required=False) is False
    assert sso_agg.email_unverified({}, required=True) is True
    assert sso_agg.email_unverified({"email_verified": " False "}, required=False) is True
