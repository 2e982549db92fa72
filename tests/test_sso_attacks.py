"""Single sign-on under attack, against real provider processes (tests/sso_support.py).

Each organization's admin, its identity provider and its people are assumed hostile to
the others: a refusal is a sign-in error page (or a 4xx problem) naming its reason, and
nothing is written (no token issued, no session). On the code before single sign-on
every one of these fails: `/app/sso/*` and `/api/v1/orgs/{org}/sso` did not exist (404).
"""

from __future__ import annotations

import base64
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from events import sso as sso_agg
from events.codec import encode
from infra.oidc import OidcClient, OidcError, plain_session
from services.surfaces.api.sso import KIT
from services.surfaces.ui.sessions import COOKIE
from tests.sso_support import (
    Idp,
    Sso,
    id_token,
    idp_fixture,  # noqa: F401  # the fixture
    idp_process,
    org_tokens,
    query_of,
    sso_api,
    sso_fixture,  # noqa: F401  # the fixture
)


async def _refused(sso: Sso, status: int, page: str, reason: str, before: int) -> None:
    assert status == 400, page
    assert f"({reason})" in page, page
    assert await org_tokens(sso, "acme") == before  # nothing written


# ---------------------------------------------------------------- the configuration


async def test_the_client_secret_is_write_only_and_in_no_event(sso: Sso, idp: Idp) -> None:
    body = await sso.configure("acme", idp, client_secret="TOPSECRET-client")
    assert body["client_secret"] == "(sensitive)"
    got = await sso.http.get("/api/v1/orgs/acme/sso")
    assert got.status == 200 and "TOPSECRET" not in str(got.body)
    events = await sso.http.app.store.read(sso_agg.config_subject("acme"))
    assert events and all(b"TOPSECRET" not in encode(e.event) for e in events)
    last = events[-1].event
    assert isinstance(last, sso_agg.SsoConfigured)
    assert last.actor == "admin" and last.secret_changed


async def test_only_the_orgs_admin_configures_it(sso: Sso, idp: Idp) -> None:
    tokens = {}
    for org in ("acme", "beta"):
        a = await sso.http.post(f"/api/v1/orgs/{org}/tokens", json={"user": "x", "role": "admin"})
        tokens[org] = a.body["token"]
    op = await sso.http.post("/api/v1/orgs/acme/tokens", json={"user": "o", "role": "operator"})
    body = {"issuer": idp.issuer, "client_id": "evil"}
    a = await sso.http.call("PUT", "/api/v1/orgs/acme/sso", json=body, token=tokens["beta"])
    assert a.status in (403, 404), a.body
    a = await sso.http.call("PUT", "/api/v1/orgs/acme/sso", json=body, token=op.body["token"])
    a.problem("forbidden", 403)
    assert (await sso.http.get("/api/v1/orgs/acme/sso")).status == 404


@pytest.mark.parametrize(
    ("body", "slug", "status"),
    [
        ({"issuer": "http://idp.example.com", "client_id": "c"}, "invalid-command", 422),
        ({"issuer": "https://u:p@idp.example.com", "client_id": "c"}, "invalid-command", 422),
        ({"issuer": "https://idp.example.com/?a=b", "client_id": "c"}, "invalid-command", 422),
        ({"issuer": "https://idp.example", "client_id": "c", "groups_claim": "a b"}, "", 422),
        ({"issuer": "https://idp.example", "client_id": "c", "extra": 1}, "invalid-body", 400),
        ({"issuer": "https://idp.example", "client_id": "c", "allowed_domains": ["*"]}, "", 422),
    ],
)
async def test_a_bad_configuration_is_a_problem(sso: Sso, body: dict, slug: str, status: int):
    a = await sso.http.call("PUT", "/api/v1/orgs/acme/sso", json=body)
    a.problem(slug or "invalid-command", status)
    assert (await sso.http.get("/api/v1/orgs/acme/sso")).status == 404


async def test_an_unknown_issuer_is_refused_before_anything_is_written(sso: Sso) -> None:
    body = {"issuer": "http://127.0.0.1:9", "client_id": "c", "client_secret": "s"}
    a = await sso.http.call("PUT", "/api/v1/orgs/acme/sso", json=body)
    assert a.problem("invalid-sso-issuer", 422)["reason"] == "sso-provider-unavailable"
    assert (await sso.http.get("/api/v1/orgs/acme/sso")).status == 404
    assert await sso.web_app[KIT].configs.secret("acme") == ""


async def test_an_issuer_on_the_control_planes_network_is_refused_by_default(
    system, tmp_path, idp: Idp
) -> None:
    async with sso_api(system, tmp_path / "rm2.sqlite", sso_allow=frozenset()) as strict:
        body = {"issuer": idp.issuer, "client_id": "c"}
        a = await strict.http.call("PUT", "/api/v1/orgs/acme/sso", json=body)
        assert a.problem("invalid-sso-issuer", 422)["reason"] == "sso-issuer-refused"


# ---------------------------------------------------------------- the flow


async def test_a_replayed_callback_is_refused(sso: Sso, idp: Idp) -> None:
    await sso.configure("acme", idp)
    await idp.user("alice", email="alice@acme.test")
    browser = sso.browser()
    back = await idp.authorize(await browser.begin("acme"), "alice")
    assert (await browser.get(back))[0] == 303
    before = await org_tokens(sso, "acme")
    status, _, page = await browser.get(back)
    await _refused(sso, status, page, "sso-replay", before)


async def test_a_flow_planted_in_another_browser_does_not_finish(sso: Sso, idp: Idp) -> None:
    """Login CSRF: the attacker's own callback, opened by the victim's browser."""
    await sso.configure("acme", idp)
    await idp.user("mallory", email="mallory@acme.test")
    back = await idp.authorize(await sso.browser().begin("acme"), "mallory")
    victim = sso.browser()
    status, _, page = await victim.get(back)
    await _refused(sso, status, page, "sso-unknown-flow", 0)
    assert victim.cookie(COOKIE) is None


async def test_an_expired_id_token_is_refused(sso: Sso, idp: Idp) -> None:
    await sso.configure("acme", idp)
    await idp.user("alice", email="alice@acme.test")
    browser = sso.browser()
    back = await idp.authorize(await browser.begin("acme"), "alice")
    sso.web_app[KIT].oidc.now = lambda: time.time() + 2 * 3600  # the token lives 1 h
    sso.web_app[KIT].flows.now = time.time
    status, _, page = await browser.get(back)
    await _refused(sso, status, page, "sso-token-expired", 0)


async def test_a_groups_claim_that_is_no_list_is_refused(sso: Sso, idp: Idp) -> None:
    await sso.configure("acme", idp, groups_claim="roles")
    await idp.user("alice", email="alice@acme.test", roles="admins")
    status, _, page = await _round_trip(sso, idp, "alice")
    await _refused(sso, status, page, "sso-bad-groups", 0)
    await idp.user("bob", email="bob@acme.test", roles=["ok", {"nested": 1}])
    status, _, page = await _round_trip(sso, idp, "bob")
    await _refused(sso, status, page, "sso-bad-groups", 0)


async def test_an_email_outside_the_allowed_domains_is_refused(sso: Sso, idp: Idp) -> None:
    await sso.configure("acme", idp, allowed_domains=["acme.test"])
    for sub, email in (("eve", "eve@evil.test"), ("sub", "eve@sub.acme.test"), ("no", "none")):
        await idp.user(sub, email=email)
        status, _, page = await _round_trip(sso, idp, sub)
        reason = "sso-bad-claims" if email == "none" else "sso-domain-not-allowed"
        await _refused(sso, status, page, reason, 0)


async def test_a_flow_begun_under_one_configuration_never_finishes_under_another(
    sso: Sso, idp: Idp
) -> None:
    await sso.configure("acme", idp)
    await idp.user("alice", email="alice@acme.test")
    browser = sso.browser()
    back = await idp.authorize(await browser.begin("acme"), "alice")
    await sso.configure("acme", idp, client_id="another-client")
    status, _, page = await browser.get(back)
    await _refused(sso, status, page, "sso-config-changed", 0)


@pytest.mark.parametrize(
    "wanted",
    ["https://evil.example/", "//evil.example/x", "/\\evil.example", "/orgs/beta", "/orgs/acme2"],
)
async def test_the_return_path_is_no_open_redirect(sso: Sso, idp: Idp, wanted: str) -> None:
    await sso.configure("acme", idp)
    await idp.user("alice", email="alice@acme.test")
    browser = sso.browser()
    assert await browser.sign_in(idp, "acme", "alice", wanted) == (303, "/orgs/acme")


async def test_the_return_path_keeps_the_orgs_own_pages(sso: Sso, idp: Idp) -> None:
    await sso.configure("acme", idp)
    await idp.user("alice", email="alice@acme.test")
    wanted = "/orgs/acme/workspaces/net"
    assert await sso.browser().sign_in(idp, "acme", "alice", wanted) == (303, wanted)


# ---------------------------------------------------------------- mix-up and substitution


async def test_a_code_of_org_bs_provider_is_refused_at_org_as_callback(
    sso: Sso, idp: Idp, tmp_path
) -> None:
    """IdP mix-up: beta's admin runs a provider of their own; a code (and its `iss`) from
    it, injected into a sign-in to acme, is refused whichever way it comes."""
    async with idp_process(tmp_path, "idp-b") as evil:
        await sso.configure("acme", idp)
        await sso.configure("beta", evil)
        await evil.user("alice", email="alice@acme.test")
        evil_back = await evil.authorize(await sso.browser().begin("beta"), "alice")
        code = query_of(evil_back)["code"]
        victim = sso.browser()
        state = query_of(await victim.begin("acme"))["state"]
        status, _, page = await victim.get(
            f"/app/sso/callback?state={state}&code={code}&iss={evil.issuer}"
        )
        await _refused(sso, status, page, "sso-issuer-mismatch", 0)
        state = query_of(await victim.begin("acme"))["state"]
        status, _, page = await victim.get(f"/app/sso/callback?state={state}&code={code}")
        await _refused(sso, status, page, "sso-code-refused", 0)


async def test_a_token_of_another_issuer_or_audience_does_not_verify(idp: Idp, tmp_path) -> None:
    """Token substitution between organizations' configurations: acme's and beta's
    clients of one provider, and a second provider."""
    oidc = OidcClient(plain_session)
    beta_token = await id_token(idp, "runplane-beta", "alice", nonce="n1")
    with pytest.raises(OidcError) as e:
        await oidc.verify(beta_token, issuer=idp.issuer, client_id="runplane-acme", nonce="n1")
    assert e.value.reason == "sso-wrong-audience"
    with pytest.raises(OidcError) as e:
        await oidc.verify(beta_token, issuer=idp.issuer, client_id="runplane-beta", nonce="n2")
    assert e.value.reason == "sso-replay"  # an old token under a new sign-in's nonce
    async with idp_process(tmp_path, "idp-b") as other:
        other_token = await id_token(other, "runplane-acme", "alice", nonce="n1")
        with pytest.raises(OidcError) as e:
            await oidc.verify(other_token, issuer=idp.issuer, client_id="runplane-acme", nonce="n1")
        assert e.value.reason in ("sso-token-refused", "sso-issuer-mismatch")
    assert await oidc.verify(beta_token, issuer=idp.issuer, client_id="runplane-beta", nonce="n1")


async def test_keys_rotate_and_made_up_key_ids_cost_one_fetch(idp: Idp) -> None:
    oidc = OidcClient(plain_session)
    first = await id_token(idp, "c", "alice", nonce="n")
    await oidc.verify(first, issuer=idp.issuer, client_id="c", nonce="n")
    assert oidc.jwks_fetches == 1
    await idp.restart()  # a new signing key, same issuer
    second = await id_token(idp, "c", "alice", nonce="n")
    await oidc.verify(second, issuer=idp.issuer, client_id="c", nonce="n")
    assert oidc.jwks_fetches == 2  # the unknown key id fetched the set again, once
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    for kid in ("made-up-1", "made-up-2", "made-up-3"):
        now = int(time.time())
        claims = {"iss": idp.issuer, "aud": "c", "sub": "x", "iat": now, "exp": now + 60}
        forged = jwt.encode({**claims, "nonce": "n"}, key, "RS256", headers={"kid": kid})
        with pytest.raises(OidcError) as e:
            await oidc.verify(forged, issuer=idp.issuer, client_id="c", nonce="n")
        assert e.value.reason == "sso-token-refused"
    assert oidc.jwks_fetches == 2  # the last forced fetch was just now: none more
    unsigned = jwt.encode({"iss": idp.issuer}, None, "none")  # type: ignore[arg-type]  # alg none
    with pytest.raises(OidcError):
        await oidc.verify(unsigned, issuer=idp.issuer, client_id="c", nonce="n")


async def test_a_token_nesting_past_the_bound_is_refused_not_a_crash(idp: Idp) -> None:
    """The provider is an organization admin's: a header or claims nested 5,000 deep made
    PyJWT's json.loads raise RecursionError (a 500 with a traceback); now a refusal."""
    oidc = OidcClient(plain_session)
    deep = "[" * 5000 + "]" * 5000
    for header, claims in ((f'{{"alg":"RS256","x":{deep}}}', "{}"), ('{"alg":"RS256"}', deep)):
        parts = [
            base64.urlsafe_b64encode(p.encode()).rstrip(b"=").decode() for p in (header, claims)
        ]
        with pytest.raises(OidcError) as e:
            await oidc.verify(
                ".".join([*parts, "c2ln"]), issuer=idp.issuer, client_id="c", nonce="n"
            )
        assert e.value.reason == "sso-token-refused" and "deeper" in str(e.value)


async def _round_trip(sso: Sso, idp: Idp, sub: str) -> tuple[int, str, str]:
    browser = sso.browser()
    back = await idp.authorize(await browser.begin("acme"), sub)
    return await browser.get(back)
