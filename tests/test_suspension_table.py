"""A suspension ends everything of the user (issue 24's loose ends, item 3): a table over
every kind of credential a person can obtain (the device flow's too), each refused after
the suspension on two api replicas, and none back after a reactivation.

The decision on the rest (as HCP Terraform's team and organization tokens outlive the
member who made them): a team token or an organization token the suspended user made
is their team's or organization's, not theirs, and stays; an admin revokes it. A Slack
mapping is an admin's statement (this Slack user is that person), no bearer secret: it
is refused while the user is suspended and holds again at a reactivation.

Already pinned elsewhere, not repeated: a `terraform login` code allowed before the
suspension (tests/test_tfe_access_attacks.py), a followed log (tests/test_attack_review_24.py),
a Slack request queued before (tests/test_slack_access_attacks.py), a replica that
learned nothing yet (tests/test_identity_cluster.py), capability URLs (services/surfaces/
tfe/holders.py, tests/test_tfe_access_attacks.py).
"""

from __future__ import annotations

import html
import re
import secrets
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlencode

from aiohttp.test_utils import TestClient, TestServer

from events import members as mb
from events import org
from events import teams as tm
from services.app.sso_flows import challenge_of
from services.processes.chat.config import ChatConfig, NotLinked
from services.root.bootstrap import Plane
from services.surfaces.ui.sessions import COOKIE
from services.surfaces.ui.web import SESSIONS
from tests.api_support import ADMIN_TOKEN, Http
from tests.device_support import Device, device_fixture  # noqa: F401  # `device`
from tests.sso_support import (
    LOOPBACK,
    Browser,
    Idp,
    Sso,
    consent_token,
    idp_fixture,  # noqa: F401  # the fixture
)

V1 = "/api/v1/orgs/acme"
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')
SLACK = "U0SAM"


async def _login_token(browser: Browser, client_id: str) -> str:
    """`terraform login` (client terraform-cli) or `runplane login --sso` (runplane-cli)
    from the browser's session: consent allowed, the code exchanged with its verifier."""
    verifier = secrets.token_urlsafe(48)
    query = {
        "client_id": client_id,
        "response_type": "code",
        "redirect_uri": "http://localhost:10003/login",
        "code_challenge": challenge_of(verifier),
        "code_challenge_method": "S256",
        "state": "st4te",
    }
    status, _, page = await browser.get("/app/oauth/authorize?" + urlencode(query))
    assert status == 200, page
    return await consent_token(browser, page, query, verifier)


async def _page_token(browser: Browser) -> str:
    """A token made on the tokens page (`/app/settings/tokens`)."""
    page = (await browser.get("/app/settings/tokens"))[2]
    data = {"csrf": _CSRF.findall(page)[0], "name": "laptop"}
    url = browser.url("/app/settings/tokens")
    async with browser.session.post(url, data=data, allow_redirects=False) as r:
        made = re.findall(r'<code id="new-token">([^<]+)</code>', await r.text())
    assert made, "no token shown"
    return html.unescape(made[0])


async def _pasted(sso: Sso, token: str) -> Browser:
    """A browser signed in at the token form with `token`."""
    browser = sso.browser()
    page = (await browser.get("/"))[2]
    data = {"csrf": _CSRF.findall(page)[0], "token": token}
    async with browser.session.post(browser.url("/signin"), data=data) as r:
        assert r.status == 200, await r.text()
    return browser


async def _device_token(device: Device, browser: Browser) -> str:
    """`runplane login --device`: a code asked, approved in the browser, then polled."""
    code = await device.code()
    assert (await device.decide(browser, code["user_code"]))[0] == 200
    device.clock.offset += 2  # past the poll interval
    status, answer = await device.poll(code["device_code"])
    assert status == 200, answer
    return str(answer["access_token"])


async def _obtain(device: Device, idp: Idp) -> tuple[dict[str, str], dict[str, Browser], str, str]:
    """Sam, an owner of acme, signs in with the provider and obtains every credential a
    person can: (personal tokens by kind, browser sessions by kind, team token, org token)."""
    sso = device.sso
    await sso.configure("acme", idp)
    await idp.user("sam", email="sam@acme.test")
    sam = sso.browser()
    assert (await sam.sign_in(idp, "acme", "sam"))[0] == 303
    session = await sso.web_app[SESSIONS].get(sam.cookie(COOKIE))
    assert session is not None
    http = sso.http
    owners = {"members": ["sam@acme.test"]}
    assert (await http.call("PUT", f"{V1}/teams/owners/members", json=owners)).status == 200
    assert (await http.post(f"{V1}/teams", json={"name": "ops"})).status == 201
    sam_id = (await http.get("/api/v1/whoami", token=session.token)).body["user_id"]
    tokens = {"single sign-on session's token": session.token}
    own = await http.post(f"{V1}/tokens", json={"kind": "user"}, token=session.token)
    tokens["personal token (API, own)"] = own.body["token"]
    made = await http.post(f"{V1}/tokens", json={"kind": "user", "user_id": sam_id})
    tokens["personal token (API, an admin's)"] = made.body["token"]
    tokens["personal token (tokens page)"] = await _page_token(sam)
    tokens["terraform login"] = await _login_token(sam, "terraform-cli")
    tokens["runplane login --sso"] = await _login_token(sam, "runplane-cli")
    tokens["runplane login --device"] = await _device_token(device, sam)
    pasted = await _pasted(sso, tokens["personal token (API, own)"])
    browsers = {"single sign-on session": sam, "token sign-in session": pasted}
    team = await http.post(
        f"{V1}/tokens", json={"kind": "team", "team": "ops"}, token=own.body["token"]
    )
    org = await http.post(
        f"{V1}/tokens", json={"user": "deploy-bot", "role": "operator"}, token=own.body["token"]
    )
    assert team.status == org.status == 201, (team.body, org.body)
    slack = {"team_id": "T0ACME", "signing_secret": "s3cret"}
    assert (await http.call("PUT", f"{V1}/chat/slack", json=slack)).status == 200
    mapped = await http.call(
        "PUT", f"{V1}/chat/slack/users/{SLACK}", json={"user": "sam@acme.test"}
    )
    assert mapped.status == 200, mapped.body
    return tokens, browsers, team.body["token"], org.body["token"]


async def _slack_user(sso: Sso, system: Plane) -> str:
    """Whom Sam's Slack id acts as ("" when refused), as chat-ops asks it."""
    try:
        who = await ChatConfig(system.app.store.nc, system.app, system.keyring).who("acme", SLACK)
    except NotLinked:
        return ""
    return who.caller.user


async def test_every_credential_of_a_suspended_user_is_refused_and_none_comes_back(
    device: Device, idp: Idp, system: Plane, tmp_path: Path
) -> None:
    """Each personal token (seven ways to get one), each browser session and the Slack
    mapping work; the user is suspended: every token is 401 `user-suspended` on this
    replica and another, every session is signed out, the Slack user is refused; the
    team and organization tokens the user made stay. Reactivated: the Slack mapping
    holds again, but no token or session of before does (revoked at the suspension).
    On main every token and session of before worked again after the reactivation."""
    tokens, browsers, team_token, org_token = await _obtain(device, idp)
    sso, http = device.sso, device.sso.http
    for kind, token in tokens.items():
        assert (await http.get("/api/v1/whoami", token=token)).status == 200, kind
    for kind, browser in browsers.items():
        assert (await browser.get("/orgs/acme"))[0] == 200, kind
    assert await _slack_user(sso, system) == "sam@acme.test"
    sam_id = (await http.get("/api/v1/whoami", token=tokens["terraform login"])).body["user_id"]

    assert (await http.post(f"{V1}/users/{sam_id}/suspend")).status == 200
    async with system.projector(tmp_path / "rm2.sqlite") as projector:
        other = system.web_app(
            projector, admin_token=ADMIN_TOKEN, repositories=None, sso_allow=LOOPBACK
        )
        async with TestClient(TestServer(other)) as client2:
            replicas = (http, Http(client2, http.api, system.app))
            for kind, token in tokens.items():
                for replica in replicas:
                    a = await replica.get(f"{V1}/workspaces", token=token)
                    assert a.status == 401, (kind, a.body)
                    assert a.body["type"].endswith("/user-suspended"), (kind, a.body)
    for kind, browser in browsers.items():
        assert (await browser.get("/orgs/acme"))[:2] == (303, "/"), kind
    assert await _slack_user(sso, system) == ""
    for token in (team_token, org_token):  # the team's and the organization's: they stay
        assert (await http.get("/api/v1/whoami", token=token)).status == 200

    assert (await http.post(f"{V1}/users/{sam_id}/reactivate")).status == 200
    assert await _slack_user(sso, system) == "sam@acme.test"
    for kind, token in tokens.items():
        a = await http.get("/api/v1/whoami", token=token)
        assert a.status == 401 and "revoked" in a.body["detail"], (kind, a.body)
    for kind, browser in browsers.items():
        assert (await browser.get("/orgs/acme"))[:2] == (303, "/"), kind


def test_a_suspension_revokes_the_users_personal_tokens_only() -> None:
    """In the same append as `org.user_suspended`: each live personal token of the user;
    not another user's, not a team's or an organization's (whoever made them), not one
    revoked already. Suspended already: nothing at all."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    alice, bob = mb.user_id_of("alice@acme.io"), mb.user_id_of("bob@acme.io")

    def issued(token_id: str, kind: str = "", owner: str = "") -> org.TokenIssued:
        role = "" if kind else "admin"
        return org.TokenIssued(
            at=now, actor="alice@acme.io", token_id=token_id, token_hash=token_id,
            user="alice@acme.io", role=role, kind=kind, owner=owner,
        )  # fmt: skip

    history: list[org.OrgEvent] = [
        org.OrgCreated(at=now, actor="admin", name="acme"),
        *(mb.UserAdded(at=now, actor="admin", user_id=u, email=e, name=e) for u, e in (
            (alice, "alice@acme.io"), (bob, "bob@acme.io"))),
        tm.TeamSet(at=now, actor="admin", name="ops"),
        issued("t-a1", "user", alice), issued("t-a2", "user", alice),
        issued("t-a3", "user", alice), issued("t-b", "user", bob),
        issued("t-team", "team", "ops"), issued("t-org"),
        org.TokenRevoked(at=now, actor="admin", token_id="t-a3"),
    ]  # fmt: skip
    state = org.fold(history)
    cmd = mb.SuspendUser(actor="admin", user_id=alice)
    events = org.decide(state, cmd, now=now, new_id=lambda: "x")
    assert events == [
        mb.UserSuspended(at=now, actor="admin", user_id=alice),
        org.TokenRevoked(at=now, actor="admin", token_id="t-a1"),
        org.TokenRevoked(at=now, actor="admin", token_id="t-a2"),
    ]
    assert org.decide(org.fold(events, state), cmd, now=now, new_id=lambda: "x") == []
