"""`terraform login` by login.v1 (services/surfaces/tfe/login.py): the browser's session, the
consent form's CSRF token, the redirect to the CLI's own listener and the PKCE verifier
are each required; a code is taken once, expires, and buys a token no stronger than the
session's. Each test shows the legitimate path working first."""

from __future__ import annotations

import base64

from services.surfaces.tfe.context import TFE
from tests.api_support import ADMIN_TOKEN
from tests.tfe_login_support import _allow, _code, _consent, _exchange, _pkce, _query, _signin
from tests.tfe_support import Tfe, tfe_fixture

__all__ = ["tfe_fixture"]


async def test_login_gives_a_new_token_of_the_sessions_user_and_role_once(tfe: Tfe) -> None:
    tokens = await tfe.org("acme")
    await _signin(tfe, tokens["operator"])
    verifier, challenge = _pkce()
    code = await _code(tfe, challenge)
    status, answer = await _exchange(tfe, code, verifier)
    assert status == 200 and answer["token_type"] == "bearer", answer
    issued = answer["access_token"]
    assert issued not in tokens.values()
    who = await tfe.tfe("GET", "/api/v2/account/details", token=issued)
    assert who.body["data"]["attributes"]["username"] == "operator-user"
    listed = await tfe.get("/api/v1/orgs/acme/tokens")
    roles = [t["role"] for t in listed.body["items"] if t["user"] == "operator-user"]
    assert roles == ["operator", "operator"]  # no stronger than the session's
    again = await _exchange(tfe, code, verifier)
    assert again == (
        400,
        {"error": "invalid_grant", "error_description": again[1]["error_description"]},
    )
    assert "used" in again[1]["error_description"]


async def test_a_code_without_its_verifier_or_tampered_or_expired_buys_nothing(tfe: Tfe) -> None:
    tokens = await tfe.org("acme")
    await _signin(tfe, tokens["admin"])
    verifier, challenge = _pkce()
    before = len((await tfe.get("/api/v1/orgs/acme/tokens")).body["items"])
    code = await _code(tfe, challenge)
    payload, mac = code.split(".")
    for what, bad_code, bad_verifier in (
        ("another verifier", code, _pkce()[0]),
        ("no verifier", code, ""),
        ("a tampered code", payload + "." + mac[::-1], verifier),
        (
            "a forged payload",
            base64.urlsafe_b64encode(b'["login-code","acme","x",9999999999]').decode().rstrip("=")
            + "."
            + mac,
            verifier,
        ),
    ):
        status, answer = await _exchange(tfe, bad_code, bad_verifier)
        assert (status, answer["error"]) == (400, "invalid_grant"), what
    status, answer = await _exchange(
        tfe, code, verifier, redirect_uri="http://localhost:10004/login"
    )
    assert (status, answer["error"]) == (400, "invalid_grant")
    signer = tfe.client.app[TFE].signer
    assert signer is not None
    real = signer.clock
    signer.clock = lambda: real() + 61
    try:
        status, answer = await _exchange(tfe, code, verifier)
        assert (status, answer["error"]) == (400, "invalid_grant")
    finally:
        signer.clock = real
    assert len((await tfe.get("/api/v1/orgs/acme/tokens")).body["items"]) == before
    status, answer = await _exchange(tfe, code, verifier)  # the right one, still in time
    assert status == 200, answer


async def test_the_authorize_page_needs_a_session_and_redirects_only_to_the_cli(tfe: Tfe) -> None:
    tokens = await tfe.org("acme")
    _, challenge = _pkce()
    status, page = await _consent(tfe, _query(challenge))
    assert status == 401 and "Sign in" in page  # no session yet
    await _signin(tfe, tokens["admin"])
    status, page = await _consent(tfe, _query(challenge))
    assert status == 200 and "admin-user" in page and "acme" in page
    for bad in (
        {"redirect_uri": "https://evil.example/login"},
        {"redirect_uri": "http://localhost:8080/login"},  # not the advertised ports
        {"redirect_uri": "http://localhost:10003/steal"},
        {"redirect_uri": "http://localhost:10003/login?next=https://evil.example"},
        {"redirect_uri": "http://user@localhost:10003/login"},
        {"client_id": "someone-else"},
        {"code_challenge_method": "plain"},
        {"code_challenge": "short"},
    ):
        status, page = await _consent(tfe, _query(challenge, **bad))
        assert status == 400, bad
        status, back = await _allow(tfe, (await _consent(tfe, _query(challenge)))[1], **bad)
        assert status == 400 and back == "", bad  # never sent anywhere
    status, page = await _consent(tfe, _query(challenge))
    assert status == 200
    status, back = await _allow(tfe, page, csrf="forged")
    assert status == 401 and back == ""
    status, back = await _allow(tfe, page, decision="deny")
    assert status == 303 and "error=access_denied" in back and "code=" not in back


async def test_an_admin_token_session_gets_no_login_token(tfe: Tfe) -> None:
    await tfe.org("acme")
    await _signin(tfe, ADMIN_TOKEN, org="acme")
    _, challenge = _pkce()
    status, page = await _consent(tfe, _query(challenge))
    assert status == 401 and "admin token" in page
