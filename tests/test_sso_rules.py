"""Single sign-on's `group_rules` (`{"group", "team"}` in the organization's SSO
configuration) put a person in a team at sign-in, as a team's own `idp_groups` do; before
this, they were stored and never applied, so a person signed in with none of the teams
the administrator mapped. A rule may not make anyone an owner (only an admin fills
owners), and a rule naming no team gives nothing."""

from __future__ import annotations

from datetime import timedelta

import msgspec

from events import members as mb
from events import org
from events import teams as tm
from events.org import OrgCreated, SignInUser
from tests.gwt import NOW, Aggregate, given
from tests.sso_support import Idp, Sso, idp_fixture, sso_fixture  # noqa: F401  # fixtures

ORG = Aggregate(initial=org.INITIAL, decide=org.decide, evolve=org.evolve)
CREATED = OrgCreated(at=NOW - timedelta(days=1), actor="admin", name="acme")
DB = tm.TeamSet(at=NOW, actor="admin", name="db")
OWNERS_RULE = ("admins", tm.OWNERS)


def _people(user_id: str) -> tuple[object, ...]:
    added = mb.UserAdded(
        at=NOW, actor="sso", user_id=user_id, email="dee@acme.io", name="dee", via="sso"
    )
    linked = mb.UserLinked(at=NOW, actor="sso", user_id=user_id, issuer="https://idp", subject="1")
    return added, linked


def test_a_rule_syncs_its_team_and_never_owners_nor_a_missing_team() -> None:
    cmd = SignInUser(
        actor="sso", email="dee@acme.io", groups=["db-eng", "admins"], issuer="https://idp",
        subject="1", rules=[("db-eng", "db"), OWNERS_RULE, ("db-eng", "nope")],
    )  # fmt: skip
    dee = mb.user_id_of("dee@acme.io")
    synced = tm.UserTeamsSynced(at=NOW, actor="sso", user_id=dee, teams=["db"])
    state = given(ORG, CREATED, DB).when(cmd).then(*_people(dee), synced)
    assert tm.teams_of(state.teams, dee) == ["db"]
    assert not tm.with_owners(state.teams)[tm.OWNERS].has(dee)
    later = ORG.decide(
        state, msgspec.structs.replace(cmd, groups=["x"]), now=NOW, new_id=lambda: "x"
    )
    assert later == [tm.UserTeamsSynced(at=NOW, actor="sso", user_id=dee, teams=[])]


async def test_the_configurations_group_rules_give_their_teams_at_sign_in(
    sso: Sso, idp: Idp
) -> None:
    """Through the real provider: team `db` has no idp_groups, only the rule names it."""
    a = await sso.http.post("/api/v1/orgs/acme/teams", json={"name": "db"})
    assert a.status == 201, a.body
    rules = [{"group": "db-eng", "team": "db"}, {"group": "admins", "team": "owners"}]
    await sso.configure("acme", idp, group_rules=rules)
    await idp.user("dee", email="dee@acme.test", groups=["db-eng", "admins"])
    status, location = await sso.browser().sign_in(idp, "acme", "dee")
    assert (status, location) == (303, "/orgs/acme"), location
    users = (await sso.http.get("/api/v1/orgs/acme/users")).body["items"]
    dee = next(u for u in users if u["email"] == "dee@acme.test")
    assert dee["teams"] == ["db"], dee


async def test_a_person_out_of_the_group_loses_the_team_at_the_next_sign_in_everywhere(
    sso: Sso, idp: Idp
) -> None:
    """The provider drops the group: the next sign-in syncs the team away, and a token
    made while they had it (an earlier session's) loses that access at once, as a
    personal token carries its user's access at each use."""
    await sso.http.workspace("acme", "db")
    made = await sso.http.post("/api/v1/orgs/acme/teams", json={"name": "db"})
    assert made.status == 201, made.body
    grant = {"team": "db", "level": "write"}
    a = await sso.http.call("PUT", "/api/v1/orgs/acme/workspaces/db/access", json=grant)
    assert a.status == 200, a.body
    await sso.configure("acme", idp, group_rules=[{"group": "db-eng", "team": "db"}])
    await idp.user("dee", email="dee@acme.test", groups=["db-eng"])
    first = sso.browser()
    assert (await first.sign_in(idp, "acme", "dee"))[0] == 303
    status, _, page = await first.get("/orgs/acme/workspaces/db")
    assert status == 200 and "Start a run" in page
    await idp.user("dee", email="dee@acme.test", groups=[])
    assert (await sso.browser().sign_in(idp, "acme", "dee"))[0] == 303
    status, _, page = await first.get("/orgs/acme/workspaces/db")
    assert status == 404, page  # the first session's token: no access to db any more
    users = (await sso.http.get("/api/v1/orgs/acme/users")).body["items"]
    assert next(u for u in users if u["email"] == "dee@acme.test")["teams"] == []
