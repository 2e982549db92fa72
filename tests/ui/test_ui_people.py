"""The UI of users, teams and access (services/surfaces/ui/people.py): an admin invites,
makes a team and grants it plan on a workspace from the pages; the user, signed in with
their personal token, may start a plan there and not an apply, sees nothing of another
workspace, and is signed out everywhere when suspended from the people page."""

from __future__ import annotations

from tests.ui.support import Ui, ui_fixture  # noqa: F401  # the fixture


async def test_people_and_access_pages_drive_what_a_user_may_do(ui: Ui) -> None:
    acme = await ui.http.org("acme")
    await ui.http.workspace("acme", "net")
    await ui.http.workspace("acme", "db")
    admin = ui.browser()
    await admin.signin(acme["admin"])
    people = await admin.get("/orgs/acme/people")
    own = people.csrf
    assert people.status == 200 and "Invite" in people.text
    invited = await admin.post("/orgs/acme/people/invite", {"email": "Pam@Acme.io"}, csrf=own)
    assert invited.status == 200 and "pam@acme.io" in invited.text
    team = await admin.post(
        "/orgs/acme/people/team", {"team": "net", "members": "pam@acme.io"}, csrf=own
    )
    assert team.status == 200
    granted = await admin.post(
        "/orgs/acme/workspaces/net/access", {"team": "net", "level": "plan"}, csrf=own
    )
    assert granted.status == 200 and "<td>net</td><td>plan</td>" in granted.text
    users = (await ui.http.get("/api/v1/orgs/acme/users")).body["items"]
    made = await ui.http.post(
        "/api/v1/orgs/acme/tokens", json={"kind": "user", "user_id": users[0]["id"]}
    )
    pam = ui.browser()
    await pam.signin(made.body["token"])
    ws = await pam.get("/orgs/acme/workspaces/net")
    assert ws.status == 200 and "Start a run" in ws.text
    assert "<option>apply</option>" not in ws.text and "/lock" not in ws.text
    mine = ws.csrf
    plan = await pam.post("/orgs/acme/workspaces/net/runs", {"type": "plan"}, csrf=mine)
    assert plan.status == 200 and "/runs/" in plan.url
    apply = await pam.post("/orgs/acme/workspaces/net/runs", {"type": "apply"}, csrf=mine)
    assert apply.status == 403 and "needs write" in apply.text
    assert (await pam.get("/orgs/acme/workspaces/db")).status == 404
    org_page = await pam.get("/orgs/acme")
    assert "/workspaces/net" in org_page.text and "/workspaces/db" not in org_page.text
    assert "Invite" not in (await pam.get("/orgs/acme/people")).text
    refused = await pam.post("/orgs/acme/people/invite", {"email": "x@acme.io"}, csrf=mine)
    assert refused.status == 403

    done = await admin.post("/orgs/acme/people/suspend", {"user": users[0]["id"]}, csrf=own)
    assert done.status == 200 and "suspended" in done.text
    gone = await pam.get("/orgs/acme/workspaces/net")
    assert "signin" in gone.url or gone.url.endswith("/"), gone.url
