"""Users, teams and grants through the API (services/surfaces/api/people.py, grants.py),
and the attacks on them: a user of org A at every level against org B's things and A's
workspaces beyond their level, a suspended user's tokens, a personal token whose team
lost its access, a capped token making a bigger one, a manage-teams user making themselves
an owner. Every refusal is a problem with a stable type."""

from __future__ import annotations

import pytest

from events.members import IdentityMismatch
from services.app.identity import sign_in_user
from tests.access_support import person
from tests.api_support import Http, http_fixture  # noqa: F401  # `http`

V1 = "/api/v1/orgs"
LEVELS = ("read", "plan", "write", "admin")


async def two_orgs(http: Http) -> None:
    for org in ("a", "b"):
        await http.org(org)
        await http.workspace(org, "net")
        await http.workspace(org, "db")


@pytest.mark.parametrize("level", LEVELS)
async def test_a_user_of_a_at_any_level_finds_nothing_of_b(http: Http, level: str) -> None:
    """Org B's workspaces, runs, users, teams, grants and tokens are 404 to every user of
    A, whatever their level in A (even admin of A)."""
    await two_orgs(http)
    token = await person(http, "a", "eve@a.io", "ops", org=level)
    run = await http.run("b", "net", "plan")
    for path in (
        f"{V1}/b",
        f"{V1}/b/workspaces",
        f"{V1}/b/workspaces/net",
        f"{V1}/b/runs/{run['id']}",
        f"{V1}/b/users",
        f"{V1}/b/teams",
        f"{V1}/b/access",
        f"{V1}/b/workspaces/net/access",
        f"{V1}/b/tokens",
    ):
        (await http.get(path, token=token)).problem("not-found", 404)
    for method, path, body in (
        ("POST", f"{V1}/b/workspaces/net/runs", {"type": "plan"}),
        ("POST", f"{V1}/b/users", {"email": "x@b.io"}),
        ("PUT", f"{V1}/b/access", {"team": "ops", "level": "admin"}),
        ("POST", f"{V1}/b/tokens", {"kind": "user"}),
    ):
        a = await http.call(method, path, json=body, token=token)
        a.problem("not-found", 404)


async def test_a_workspace_grant_holds_there_only_and_each_level_does_what_it_says(
    http: Http,
) -> None:
    """plan on net: net's runs read, plans queued, applies 403; db is 404 (not even seen),
    and lists show net alone."""
    await two_orgs(http)
    token = await person(http, "a", "pat@a.io", "netplan", **{"workspaces/net": "plan"})
    other = await http.run("a", "db", "plan")
    (await http.get(f"{V1}/a/workspaces/db", token=token)).problem("not-found", 404)
    (await http.get(f"{V1}/a/runs/{other['id']}", token=token)).problem("not-found", 404)
    a = await http.post(f"{V1}/a/workspaces/db/runs", json={"type": "plan"}, token=token)
    a.problem("not-found", 404)
    assert (await http.get(f"{V1}/a/workspaces/net", token=token)).status == 200
    plan = await http.post(f"{V1}/a/workspaces/net/runs", json={"type": "plan"}, token=token)
    assert plan.status == 201, plan.body
    apply = await http.post(f"{V1}/a/workspaces/net/runs", json={"type": "apply"}, token=token)
    assert "needs write" in apply.problem("forbidden", 403)["detail"]
    a = await http.post(f"{V1}/a/workspaces/net/lock", json={"reason": "x"}, token=token)
    a.problem("forbidden", 403)
    listed = await http.get(f"{V1}/a/workspaces", token=token)
    assert [w["name"] for w in listed.body["items"]] == ["net"]
    runs = await http.get(f"{V1}/a/runs", token=token)
    assert {r["workspace"] for r in runs.body["items"]} == {"net"}
    me = await http.get("/api/v1/whoami", token=token)
    assert me.body["teams"] == ["netplan"] and me.body["kind"] == "user"
    assert me.body["access"]["workspaces"] == {"net": "plan"}


async def test_a_folder_grant_holds_for_workspaces_in_nested_folders(http: Http) -> None:
    await http.org("a")
    assert (await http.post(f"{V1}/a/folders", json={"name": "infra"})).status == 201
    a = await http.post(f"{V1}/a/folders", json={"name": "prod", "parent": "infra"})
    assert a.status == 201
    await http.workspace("a", "net", folder="prod")
    await http.workspace("a", "db")
    token = await person(http, "a", "fay@a.io", "infra", **{"folders/infra": "write"})
    a = await http.post(f"{V1}/a/workspaces/net/runs", json={"type": "apply"}, token=token)
    assert a.status == 201, a.body
    (await http.get(f"{V1}/a/workspaces/db", token=token)).problem("not-found", 404)


async def test_suspension_ends_every_token_of_the_user_at_once_and_reactivation_restores_the_user(
    http: Http,
) -> None:
    """Reactivated, the user may have tokens again; the ones of before stay revoked (a
    suspension ends them: one that leaked does not come back with its user)."""
    await http.org("a")
    token = await person(http, "a", "sam@a.io", "ops", org="read")
    user_id = (await http.get("/api/v1/whoami", token=token)).body["user_id"]
    assert (await http.get(f"{V1}/a/workspaces", token=token)).status == 200
    a = await http.post(f"{V1}/a/users/{user_id}/suspend", json={"reason": "left"})
    assert a.status == 200 and a.body["state"] == "suspended"
    (await http.get(f"{V1}/a/workspaces", token=token)).problem("user-suspended", 401)
    (await http.get("/api/v1/whoami", token=token)).problem("user-suspended", 401)
    made = await http.post(f"{V1}/a/tokens", json={"kind": "user", "user_id": user_id})
    made.problem("forbidden", 403)  # nothing new for a suspended user either
    assert (await http.post(f"{V1}/a/users/{user_id}/reactivate")).status == 200
    (await http.get(f"{V1}/a/workspaces", token=token)).problem("unauthorized", 401)
    made = await http.post(f"{V1}/a/tokens", json={"kind": "user", "user_id": user_id})
    assert made.status == 201, made.body
    assert (await http.get(f"{V1}/a/workspaces", token=made.body["token"])).status == 200


async def test_a_personal_token_carries_its_users_access_now_not_at_issue(http: Http) -> None:
    """The team loses its grant: the token made while it had it reads nothing more."""
    await http.org("a")
    await http.workspace("a", "net")
    token = await person(http, "a", "tom@a.io", "net", **{"workspaces/net": "write"})
    assert (await http.get(f"{V1}/a/workspaces/net", token=token)).status == 200
    a = await http.call(
        "PUT", f"{V1}/a/workspaces/net/access", json={"team": "net", "level": "none"}
    )
    assert a.status == 200 and a.body["items"] == [{"team": "owners", "level": "admin"}]
    (await http.get(f"{V1}/a/workspaces/net", token=token)).problem("not-found", 404)


async def test_a_capped_token_makes_no_token_above_its_cap(http: Http) -> None:
    await http.org("a")
    token = await person(http, "a", "cap@a.io", "admins", org="admin")
    capped = await http.post(f"{V1}/a/tokens", json={"kind": "user", "level": "read"}, token=token)
    assert capped.status == 201 and capped.body["level"] == "read"
    bigger = await http.post(
        f"{V1}/a/tokens", json={"kind": "user", "level": "admin"}, token=capped.body["token"]
    )
    assert bigger.status == 201 and bigger.body["level"] == "read"
    a = await http.post(f"{V1}/a/workspaces", json={"name": "x", "repository": "https://e/x"},
                        token=capped.body["token"])  # fmt: skip
    a.problem("forbidden", 403)


async def test_manage_teams_may_not_make_itself_an_owner_nor_give_rights(http: Http) -> None:
    await http.org("a")
    a = await http.post(f"{V1}/a/teams", json={"name": "hr", "rights": ["manage-teams"]})
    assert a.status == 201, a.body
    token = await person(http, "a", "hr@a.io")
    me = (await http.get("/api/v1/whoami", token=token)).body["user_id"]
    assert (
        await http.call("PUT", f"{V1}/a/teams/hr/members", json={"members": [me]})
    ).status == 200
    owners = await http.call(
        "PUT", f"{V1}/a/teams/owners/members", json={"members": [me]}, token=token
    )
    owners.problem("forbidden", 403)
    rights = await http.post(
        f"{V1}/a/teams", json={"name": "x", "rights": ["manage-workspaces"]}, token=token
    )
    rights.problem("forbidden", 403)
    org_grant = await http.call(
        "PUT", f"{V1}/a/access", json={"team": "hr", "level": "admin"}, token=token
    )
    org_grant.problem("forbidden", 403)
    a = await http.post(f"{V1}/a/users", json={"email": "new@a.io"}, token=token)
    assert a.status == 201  # what the right is for


async def test_role_tokens_keep_working_as_before(http: Http) -> None:
    tokens = await http.org("a")
    await http.workspace("a", "net")
    assert (
        await http.post(f"{V1}/a/workspaces/net/runs", json={"type": "apply"},
                        token=tokens["operator"])
    ).status == 201  # fmt: skip
    a = await http.post(
        f"{V1}/a/workspaces/net/runs", json={"type": "plan"}, token=tokens["viewer"]
    )
    a.problem("forbidden", 403)
    me = (await http.get("/api/v1/whoami", token=tokens["viewer"])).body
    assert me["kind"] == "org" and me["access"]["organization"] == "read"


async def test_sign_in_creates_the_user_with_synced_teams_and_a_working_token(
    http: Http,
) -> None:
    """The hook SSO calls: the user, their teams from the IdP's groups, a personal token
    that carries those teams' access; a second identity for the same email is refused."""
    await http.org("a")
    await http.workspace("a", "net")
    a = await http.post(f"{V1}/a/teams", json={"name": "net", "idp_groups": ["g-net"]})
    assert a.status == 201
    grant = {"team": "net", "level": "plan"}
    assert (await http.call("PUT", f"{V1}/a/workspaces/net/access", json=grant)).status == 200
    signed = await sign_in_user(
        http.app, "a", email="Ann@A.io", name="Ann", groups=["g-net"], issuer="https://idp",
        subject="42",
    )  # fmt: skip
    assert signed.teams == ["net"] and signed.email == "ann@a.io"
    await http.api.after_write(signed.seq)
    token = signed.token
    a = await http.post(f"{V1}/a/workspaces/net/runs", json={"type": "plan"}, token=token)
    assert a.status == 201, a.body
    users = (await http.get(f"{V1}/a/users")).body["items"]
    assert [(u["email"], u["via"], u["teams"]) for u in users] == [("ann@a.io", "sso", ["net"])]
    with pytest.raises(IdentityMismatch):
        await sign_in_user(
            http.app, "a", email="ann@a.io", name="x", groups=[], issuer="https://evil",
            subject="42",
        )  # fmt: skip
