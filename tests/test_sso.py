"""Single sign-on against a real OpenID provider process (tests/sso_support.py): the
configuration API, the web UI's round trip, and the sign-in landing as the person."""

from __future__ import annotations

from tests.sso_support import Idp, Sso, idp_fixture, sso_fixture  # noqa: F401  # the fixtures


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
