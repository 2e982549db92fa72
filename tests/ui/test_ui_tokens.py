"""The signed-in person's tokens page (services/surfaces/ui/tokens.py): their own personal
tokens listed (name, made, last used, expiry) and revoked with the page's CSRF token;
another user's, a team's, an organization's or another organization's token is never
shown and never revoked from it (not found), and a post without the CSRF token or from
another origin revokes nothing."""

from __future__ import annotations

import re
from typing import Any

from tests.ui.support import Browser, Ui, ui_fixture  # noqa: F401  # the fixture

V1 = "/api/v1/orgs"


async def _person(ui: Ui, org: str, email: str, *names: str) -> tuple[str, list[dict[str, Any]]]:
    """Invite `email` into `org`; one personal token per name: (user id, [answers])."""
    a = await ui.http.post(f"{V1}/{org}/users", json={"email": email})
    assert a.status == 201, a.body
    made = []
    for name in names:
        body = {"kind": "user", "user_id": a.body["id"], "name": name}
        t = await ui.http.post(f"{V1}/{org}/tokens", json=body)
        assert t.status == 201, t.body
        made.append(t.body)
    return str(a.body["id"]), made


def _listed(page: str) -> list[str]:
    """The token ids the page lists."""
    return re.findall(r'<tr id="token-([a-z0-9-]+)">', page)


async def test_a_user_sees_and_revokes_only_their_own_tokens(ui: Ui) -> None:
    await ui.http.org("acme")
    await ui.http.org("beta")
    pam_id, (pam_laptop, pam_ci) = await _person(ui, "acme", "pam@acme.io", "laptop", "ci")
    _, (sam_token,) = await _person(ui, "acme", "sam@acme.io", "sams-secret-name")
    _, (bea_token,) = await _person(ui, "beta", "bea@beta.io", "beas")
    team = await ui.http.post(f"{V1}/acme/teams", json={"name": "ops"})
    assert team.status == 201, team.body
    team_token = await ui.http.post(
        f"{V1}/acme/tokens", json={"kind": "team", "team": "ops", "name": "ops-ci"}
    )
    assert team_token.status == 201, team_token.body
    body = {"kind": "user", "user_id": pam_id, "name": "short", "expires_in": 3600}
    expiring = await ui.http.post(f"{V1}/acme/tokens", json=body)
    assert expiring.status == 201, expiring.body

    pam = ui.browser()
    await pam.signin(pam_laptop["token"])
    page = await pam.get("/app/settings/tokens")
    assert page.status == 200, page.text
    mine = {pam_laptop["token_id"], pam_ci["token_id"], expiring.body["token_id"]}
    assert set(_listed(page.text)) == mine, page.text
    assert "laptop" in page.text and "(this session)" in page.text and "ci" in page.text
    assert expiring.body["expires_at"] in page.text  # its expiry; the others never
    for theirs in (sam_token, bea_token, team_token.body):
        assert theirs["token_id"] not in page.text
    assert "sams-secret-name" not in page.text and "ops-ci" not in page.text
    used = re.search(rf'<tr id="token-{pam_laptop["token_id"]}">.*?</tr>', page.text, re.S)
    assert used and "never" not in used.group(0).split("</time>")[1], used  # last used: now

    # Another user's, a team's, another organization's token: not found, still working.
    for theirs in (sam_token, team_token.body, bea_token):
        refused = await pam.post("/app/settings/tokens/revoke", {"token": theirs["token_id"]})
        assert refused.status == 404 and "not found" in refused.text, refused.text
        still = await ui.http.get("/api/v1/whoami", token=theirs["token"])
        assert still.status == 200, (theirs["token_id"], still.body)
    # Without the page's CSRF token, or from another origin: nothing revoked.
    page = await pam.get("/app/settings/tokens")
    no_csrf = await pam.post("/app/settings/tokens/revoke", {"token": pam_ci["token_id"]}, csrf="")
    assert no_csrf.status == 403
    elsewhere = await pam.post(
        "/app/settings/tokens/revoke",
        {"token": pam_ci["token_id"]},
        csrf=page.csrf,
        headers={"Origin": "https://evil.example"},
    )
    assert elsewhere.status == 403
    assert (await ui.http.get("/api/v1/whoami", token=pam_ci["token"])).status == 200

    # Their own: revoked, gone from the list, refused by the API at once.
    page = await pam.get("/app/settings/tokens")
    done = await pam.post("/app/settings/tokens/revoke", {"token": pam_ci["token_id"]})
    assert done.status == 200 and done.url.endswith("/app/settings/tokens"), done.url
    assert pam_ci["token_id"] not in _listed(done.text)
    gone = await ui.http.get("/api/v1/whoami", token=pam_ci["token"])
    gone.problem("unauthorized", 401)
    events = (await ui.http.get(f"{V1}/acme/tokens")).body["items"]
    assert pam_ci["token_id"] not in {t["token_id"] for t in events}
    named = {t["token_id"]: t["name"] for t in events}
    assert (
        named[pam_laptop["token_id"]] == "laptop" and named[team_token.body["token_id"]] == "ops-ci"
    )


async def test_revoking_the_sessions_own_token_signs_the_browser_out(ui: Ui) -> None:
    await ui.http.org("acme")
    _, (own,) = await _person(ui, "acme", "kim@acme.io", "browser")
    kim = ui.browser()
    await kim.signin(own["token"])
    page = await kim.get("/app/settings/tokens")
    assert "(this session)" in page.text
    done = await kim.post("/app/settings/tokens/revoke", {"token": own["token_id"]})
    assert done.status == 200 and 'action="/signin"' in done.text, done.url
    assert (await kim.get("/orgs/acme")).url.endswith("/"), "still signed in"
    (await ui.http.get("/api/v1/whoami", token=own["token"])).problem("unauthorized", 401)


async def test_an_organization_token_session_lists_no_tokens_and_revokes_none(ui: Ui) -> None:
    """A role token of before users owns nothing: not even the admin's own org tokens."""
    tokens = await ui.http.org("acme")
    _, (pam,) = await _person(ui, "acme", "pam@acme.io", "laptop")
    admin = ui.browser()
    await admin.signin(tokens["admin"])
    page = await admin.get("/app/settings/tokens")
    assert page.status == 200 and _listed(page.text) == [], page.text
    assert "owns no personal tokens" in page.text
    refused = await admin.post("/app/settings/tokens/revoke", {"token": pam["token_id"]})
    assert refused.status == 404
    assert (await ui.http.get("/api/v1/whoami", token=pam["token"])).status == 200
