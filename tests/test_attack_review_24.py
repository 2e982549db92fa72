"""An attacker's review of issue 24 (users, teams, access, single sign-on, workload
identity) as it landed on main at 459f782: each finding is a test that failed there.

The attacker is a user of organization `a` holding some access (the right
`manage-teams`, a level on a workspace, nothing), a hostile identity provider's user, or a
stranger's page in the victim's browser. What each test pins down is in its name; the
review's table (every attempt, those refused already included) is in the branch's report.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from events import approval
from events.approval import Caller
from events.errors import Forbidden, Invalid
from events.values import Snapshot
from services.app.identity import sign_in_user
from tests.api_support import Http, http_fixture  # noqa: F401  # `http`
from tests.sso_support import Idp, Sso, idp_fixture, sso_fixture  # noqa: F401  # fixtures
from tests.ui.support import Ui, ui_fixture  # noqa: F401  # `ui`

V1 = "/api/v1/orgs"


async def person(http: Http, org: str, email: str, team: str = "", **grant: str) -> str:
    """Invite `email` into `org` (in `team` if given, that team granted `grant`
    {target: level}, "org" the organization); a personal token of theirs."""
    a = await http.post(f"{V1}/{org}/users", json={"email": email})
    assert a.status == 201, a.body
    if team:
        made = await http.post(f"{V1}/{org}/teams", json={"name": team})
        assert made.status in (201, 409), made.body
        a2 = await http.call("PUT", f"{V1}/{org}/teams/{team}/members", json={"members": [email]})
        assert a2.status == 200, a2.body
        for target, level in grant.items():
            await grant_to(http, org, team, target, level)
    t = await http.post(f"{V1}/{org}/tokens", json={"kind": "user", "user_id": a.body["id"]})
    assert t.status == 201, t.body
    return str(t.body["token"])


async def grant_to(http: Http, org: str, team: str, target: str, level: str) -> None:
    path = f"{V1}/{org}/access" if target == "org" else f"{V1}/{org}/{target}/access"
    a = await http.call("PUT", path, json={"team": team, "level": level})
    assert a.status == 200, a.body


async def team(http: Http, org: str, name: str, **body: Any) -> None:
    a = await http.post(f"{V1}/{org}/teams", json={"name": name, **body})
    assert a.status == 201, a.body


async def user_id(http: Http, token: str) -> str:
    return str((await http.get("/api/v1/whoami", token=token)).body["user_id"])


async def hr_and_platform(http: Http) -> str:
    """Org `a` with a workspace `net`, a team `platform` that is admin of the whole
    organization and a team `hr` with the right manage-teams (and no level anywhere);
    the token of hr@a.io, hr's member."""
    await http.org("a")
    await http.workspace("a", "net")
    await team(http, "a", "platform")
    await grant_to(http, "a", "platform", "org", "admin")
    await team(http, "a", "hr", rights=["manage-teams"])
    return await person(http, "a", "hr@a.io", "hr")


# ------------------------------------------------ manage-teams is not a way to more


async def test_manage_teams_may_not_join_a_team_that_holds_more_than_it(http: Http) -> None:
    """hr (manage-teams, no level) puts itself into `platform` (admin of the org): 403,
    and it stays unable to make a workspace. On main: 200, then org admin."""
    hr = await hr_and_platform(http)
    me = await user_id(http, hr)
    joined = await http.call("PUT", f"{V1}/a/teams/platform/members", json={"members": [me]},
                             token=hr)  # fmt: skip
    assert "platform" in joined.problem("forbidden", 403)["detail"]
    made = await http.post(
        f"{V1}/a/workspaces", json={"name": "x", "repository": "https://e/x.git"}, token=hr
    )
    made.problem("forbidden", 403)


async def test_manage_teams_may_not_put_a_confederate_into_a_team_above_it(http: Http) -> None:
    """Nor anyone else (by email): a team's members hold what the team holds, and hr may
    hand out no more than it holds itself; a team within its own access stays its to fill."""
    hr = await hr_and_platform(http)
    await http.post(f"{V1}/a/users", json={"email": "pal@a.io"})
    a = await http.call("PUT", f"{V1}/a/teams/platform/members", json={"members": ["pal@a.io"]},
                        token=hr)  # fmt: skip
    a.problem("forbidden", 403)
    await team(http, "a", "newcomers")
    ok = await http.call("PUT", f"{V1}/a/teams/newcomers/members",
                         json={"members": ["pal@a.io"]}, token=hr)  # fmt: skip
    assert ok.status == 200, ok.body


async def test_manage_teams_may_not_join_a_team_holding_a_right(http: Http) -> None:
    """A team with manage-policies: its rights are an org admin's to give, so are its
    members to a manage-teams user who lacks the right."""
    hr = await hr_and_platform(http)
    await team(http, "a", "policy", rights=["manage-policies"])
    me = await user_id(http, hr)
    a = await http.call("PUT", f"{V1}/a/teams/policy/members", json={"members": [me]}, token=hr)
    assert "manage-policies" in a.problem("forbidden", 403)["detail"]


async def test_manage_teams_may_not_join_a_team_holding_admin_on_a_workspace(
    http: Http,
) -> None:
    """A grant on one workspace counts too: hr reads net at most, `netadmins` is admin."""
    hr = await hr_and_platform(http)
    await team(http, "a", "netadmins")
    await grant_to(http, "a", "netadmins", "workspaces/net", "admin")
    me = await user_id(http, hr)
    a = await http.call("PUT", f"{V1}/a/teams/netadmins/members", json={"members": [me]},
                        token=hr)  # fmt: skip
    a.problem("forbidden", 403)


async def test_manage_teams_may_not_mint_a_token_of_a_team_above_it(http: Http) -> None:
    """A team token acts as the team: minting platform's is becoming org admin. On main
    201, and the token made workspaces."""
    hr = await hr_and_platform(http)
    a = await http.post(f"{V1}/a/tokens", json={"kind": "team", "team": "platform"}, token=hr)
    a.problem("forbidden", 403)


async def test_manage_teams_may_not_map_its_own_group_onto_a_team(http: Http) -> None:
    """`idp_groups` decides who single sign-on puts into a team at every sign-in: mapping
    a group of one's own onto `platform` is joining it. Which groups map to teams is the
    single sign-on configuration's matter: an org admin's, as PUT .../sso is."""
    hr = await hr_and_platform(http)
    a = await http.call("PATCH", f"{V1}/a/teams/platform", json={"idp_groups": ["everyone"]},
                        token=hr)  # fmt: skip
    a.problem("forbidden", 403)
    made = await http.post(f"{V1}/a/teams", json={"name": "x", "idp_groups": ["g"]}, token=hr)
    made.problem("forbidden", 403)
    state = (await http.get(f"{V1}/a/teams/platform")).body
    assert state["idp_groups"] == []


async def test_manage_teams_may_not_join_a_team_the_approvers_rule_names(http: Http) -> None:
    """net's approvers are `team:release`; hr also holds write on net (team netw). Joining
    release would pass the approvers rule on its own runs: a person may not add
    themselves to a team (an org admin may)."""
    hr = await hr_and_platform(http)
    a = await http.call("PUT", f"{V1}/a/teams/hr/members", json={"members": ["hr@a.io"]})
    assert a.status == 200
    await grant_to(http, "a", "hr", "workspaces/net", "write")
    ok = await http.call("PATCH", f"{V1}/a/workspaces/net/settings",
                         json={"approvers": ["team:release"]})  # fmt: skip
    assert ok.status == 200, ok.body
    await team(http, "a", "release")
    me = await user_id(http, hr)
    joined = await http.call("PUT", f"{V1}/a/teams/release/members", json={"members": [me]},
                             token=hr)  # fmt: skip
    joined.problem("forbidden", 403)


async def test_approval_groups_stay_an_org_admins_to_fill(http: Http) -> None:
    """`group:<name>` approvers: before users, only an org admin set a group's members;
    issue 24 handed that to manage-teams, who could then list themselves as an approver."""
    hr = await hr_and_platform(http)
    made = await http.post(f"{V1}/a/groups", json={"name": "cab", "members": ["hr@a.io"]},
                           token=hr)  # fmt: skip
    made.problem("forbidden", 403)
    assert (await http.post(f"{V1}/a/groups", json={"name": "cab", "members": []})).status == 201
    a = await http.call("PUT", f"{V1}/a/groups/cab/members", json={"members": ["hr@a.io"]},
                        token=hr)  # fmt: skip
    a.problem("forbidden", 403)


async def test_manage_teams_may_not_suspend_or_reactivate_someone_above_it(
    http: Http,
) -> None:
    """An admin of the organization through `platform` (not owners): hr may not lock them
    out, nor bring back one an admin suspended."""
    hr = await hr_and_platform(http)
    boss = await person(http, "a", "boss@a.io", "platform")
    boss_id = await user_id(http, boss)
    a = await http.post(f"{V1}/a/users/{boss_id}/suspend", token=hr)
    a.problem("forbidden", 403)
    assert (await http.post(f"{V1}/a/users/{boss_id}/suspend")).status == 200
    back = await http.post(f"{V1}/a/users/{boss_id}/reactivate", token=hr)
    back.problem("forbidden", 403)


async def test_the_people_page_form_refuses_the_same_escalation(ui: Ui) -> None:
    """The UI's "Set members" form does what the API does: hr may not put itself into
    platform there either (on main: 303 to the people page, hr an org admin)."""
    http = ui.http
    hr = await hr_and_platform(http)
    b = ui.browser()
    await b.signin(hr)
    people = await b.get("/orgs/a/people")
    assert people.status == 200
    a = await b.post("/orgs/a/people/team", {"team": "platform", "members": "hr@a.io"})
    assert a.status == 403, (a.status, a.text[:300])
    me = await http.get("/api/v1/whoami", token=hr)
    assert me.body["teams"] == ["hr"]


# ------------------------------------------------ what a reader sees


async def test_teams_show_a_reader_no_workspace_it_may_not_read(http: Http) -> None:
    """A workspace the caller may not read is 404 to it everywhere; the teams list named
    it in every grant (`workspace:secret`), and the users list in their teams' grants."""
    await http.org("a")
    await http.workspace("a", "net")
    await http.workspace("a", "secret")
    await team(http, "a", "vault")
    await grant_to(http, "a", "vault", "workspaces/secret", "admin")
    token = await person(http, "a", "pat@a.io", "netread", **{"workspaces/net": "read"})
    (await http.get(f"{V1}/a/workspaces/secret", token=token)).problem("not-found", 404)
    for path in (f"{V1}/a/teams", f"{V1}/a/teams/vault"):
        a = await http.get(path, token=token)
        assert a.status == 200 and "secret" not in str(a.body), (path, a.body)
    admin = await http.get(f"{V1}/a/teams/vault")
    assert admin.body["access"] == [{"target": "workspace:secret", "level": "admin"}]


# ------------------------------------------------ emails that fold into another


@pytest.mark.parametrize(
    ("victim", "lookalike"),
    [("sam@a.io", "\u017fam@a.io"), ("kate@a.io", "\u212aate@a.io"), ("ffi@a.io", "\ufb00i@a.io")],
)
async def test_an_email_that_folds_into_another_users_is_refused(
    http: Http, victim: str, lookalike: str
) -> None:
    """The victim is invited into owners and has not signed in yet. An identity provider's
    user whose email is `\u017fam@a.io` (LATIN SMALL LETTER LONG S, which case-folds to
    `s`; KELVIN SIGN to `k`; the ligature ff to `ff`) signed in as the victim on main: the
    same user id, owners. A non-ASCII address is refused (sign-in and invitation alike)."""
    await http.org("a")
    invited = await http.post(f"{V1}/a/users", json={"email": victim})
    owners = {"members": [invited.body["id"]]}
    assert (await http.call("PUT", f"{V1}/a/teams/owners/members", json=owners)).status == 200
    with pytest.raises(Invalid):
        await sign_in_user(http.app, "a", email=lookalike, name="x", groups=[],
                           issuer="https://idp", subject="mallory")  # fmt: skip
    a = await http.post(f"{V1}/a/users", json={"email": lookalike})
    a.problem("invalid-command", 422)


# ------------------------------------------------ single sign-on's start


async def test_a_stranger_page_cannot_start_a_sign_in_in_the_victims_browser(
    sso: Sso, idp: Idp
) -> None:
    """Login CSRF by the front door: org acme's (hostile) admin runs its own provider,
    which answers at once; a page of theirs sends the victim's browser to
    /app/sso/start?org=acme, the provider answers for the attacker's account, and the
    callback ends the victim's session and signs them in as the attacker. The state
    binding does not help: the browser started the flow itself. A cross-site start is
    refused (Fetch Metadata); the sign-in page's own button and a typed URL still work."""
    await sso.configure("acme", idp)
    b = sso.browser()
    async with b.session.get(
        b.url("/app/sso/start"),
        params={"org": "acme"},
        headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"},
        allow_redirects=False,
    ) as r:
        assert r.status == 403, (r.status, r.headers.get("Location"))
        assert "sso-cross-site" in await r.text()
    for site in ("same-origin", "none"):
        async with b.session.get(
            b.url("/app/sso/start"),
            params={"org": "acme"},
            headers={"Sec-Fetch-Site": site},
            allow_redirects=False,
        ) as r:
            assert r.status == 303, (site, r.status)


# ------------------------------------------------ a token outliving its user


async def test_a_followed_log_ends_when_its_user_is_suspended(http: Http) -> None:
    """`GET .../logs?follow=1` was authenticated once: on main the stream of a suspended
    user (or a revoked token) went on until the run ended, hours of an apply's log later.
    It now ends within a recheck with an `error` event."""
    await http.org("a")
    await http.workspace("a", "net")
    token = await person(http, "a", "sue@a.io", "ops", **{"workspaces/net": "read"})
    sue = await user_id(http, token)
    run = await http.run("a", "net", "plan")  # no executor here: it never ends
    headers = {"Authorization": f"Bearer {token}"}
    path = f"{V1}/a/runs/{run['id']}/logs?follow=1"
    async with http.client.get(path, headers=headers) as stream:
        assert stream.status == 200
        assert (await http.post(f"{V1}/a/users/{sue}/suspend")).status == 200
        rest = await asyncio.wait_for(stream.content.read(), timeout=20)
    assert b"event: error" in rest and b"is suspended" in rest, rest


# ------------------------------------------------ four eyes and team tokens


async def test_four_eyes_takes_no_team_token_for_a_person(http: Http) -> None:
    """hr (manage-teams, write on net through its team) may mint its own team's token
    (it holds all the team holds). With four_eyes on, a run it created with its personal
    token was approved on main with that team token (`team:hr` is not `hr@a.io`), and the
    other way round: one person, both eyes."""
    hr = await hr_and_platform(http)
    await grant_to(http, "a", "hr", "workspaces/net", "write")
    made = await http.post(f"{V1}/a/tokens", json={"kind": "team", "team": "hr"}, token=hr)
    assert made.status == 201, made.body  # a member's own team, no more than it holds
    four = Snapshot(settings={"four_eyes": {"value": True, "origin": "workspace"}})
    as_team = Caller(user="team:hr", teams=["hr"], level="write")
    with pytest.raises(Forbidden, match="four_eyes"):
        approval.check("approve", as_team, creator="hr@a.io", snapshot=four, groups={})
    as_person = Caller(user="hr@a.io", teams=["hr"], level="write")
    with pytest.raises(Forbidden, match="four_eyes"):
        approval.check("approve", as_person, creator="team:hr", snapshot=four, groups={})
    other = Caller(user="ann@a.io", teams=["ops"], level="write")
    approval.check("approve", other, creator="team:hr", snapshot=four, groups={})
    approval.check("discard", as_team, creator="hr@a.io", snapshot=four, groups={})


# ------------------------------------------------ hostile input on the new routes


async def test_hostile_bodies_on_the_people_routes_are_4xx_problems_never_500(
    http: Http,
) -> None:
    """Deep JSON, duplicate keys, a huge body, look-alike and control characters in names,
    unknown levels and kinds: each new route answers a problem with a stable type (this
    held on main already; kept as the review's record)."""
    await http.org("a")
    await http.workspace("a", "net")
    await team(http, "a", "ops")
    deep = "[" * 5000 + "]" * 5000
    raw = [
        ("POST", f"{V1}/a/users", '{"email": ' + deep + "}"),
        ("PUT", f"{V1}/a/teams/ops/members", '{"members": ' + deep + "}"),
        ("PUT", f"{V1}/a/access", '{"team": "ops", "level": "read", "level": "admin"}'),
        ("PUT", f"{V1}/a/sso", '{"issuer": ' + deep + "}"),
        ("POST", f"{V1}/a/users", '{"email": "' + "x" * (2 * 1024 * 1024) + '@a.io"}'),
    ]
    for method, path, text in raw:
        a = await http.call(method, path, data=text.encode(),
                            headers={"Content-Type": "application/json"})  # fmt: skip
        assert 400 <= a.status < 500 and a.content_type.startswith("application/problem"), (
            path,
            a.status,
        )
    bodies = [
        ("POST", f"{V1}/a/users", {"email": "ann@a.io\u202e"}),
        ("POST", f"{V1}/a/users", {"email": "ann\u0000@a.io"}),
        ("POST", f"{V1}/a/users", {"email": "ann@a.io", "name": "\u202egnp.exe"}),
        ("POST", f"{V1}/a/teams", {"name": "\uff4f\uff57\uff4e\uff45\uff52\uff53"}),
        ("POST", f"{V1}/a/teams", {"name": "owners"}),
        ("PATCH", f"{V1}/a/teams/owners", {"rights": ["manage-vcs"]}),
        ("POST", f"{V1}/a/teams", {"name": "x", "idp_groups": ["a\nb"]}),
        ("PUT", f"{V1}/a/access", {"team": "ops", "level": "ADMIN"}),
        ("PUT", f"{V1}/a/access", {"team": "owners", "level": "read"}),
        ("PUT", f"{V1}/a/workspaces/nope/access", {"team": "ops", "level": "read"}),
        ("PUT", f"{V1}/a/folders/nope/access", {"team": "ops", "level": "read"}),
        ("PUT", f"{V1}/a/teams/ops/members", {"members": ["u-../../x", "stranger@b.io"]}),
        ("POST", f"{V1}/a/tokens", {"kind": "robot"}),
        ("POST", f"{V1}/a/tokens", {"kind": "user", "user_id": "u-nobody", "level": "root"}),
        ("POST", f"{V1}/a/users/u-%E2%80%AE/suspend", {}),
        ("PUT", f"{V1}/a/sso", {"issuer": "javascript:alert(1)", "client_id": "x"}),
        ("PUT", f"{V1}/a/sso", {"issuer": "http://169.254.169.254/", "client_id": "x"}),
    ]
    for method, path, body in bodies:
        a = await http.call(method, path, json=body)
        assert 400 <= a.status < 500 and a.content_type.startswith("application/problem"), (
            path,
            body,
            a.status,
            a.body,
        )
