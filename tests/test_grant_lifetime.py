"""A grant on a workspace ends with the workspace (issue 24's loose ends, item 2).

Grants name a workspace by name (`workspace:<name>`). On main a purge freed the name and
left every grant on it: a team granted write on the old `prod` held write on a `prod`
made again. Now the purge revokes them (`org.access_revoked`, reason "workspace
purged"), a deleted workspace takes no new grant, and a replay of the organization's
events gives the same answer as the live aggregate.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from events import access, org
from events import teams as tm
from events.codec import decode, encode, org_subject
from events.org import OrgCreated
from services.surfaces.api import grants
from services.surfaces.api.problems import Problem
from tests.access_support import person
from tests.api_support import Http, http_fixture  # noqa: F401  # `http`
from tests.gwt import NOW, Aggregate, given

V1 = "/api/v1/orgs"
ORG = Aggregate(initial=org.INITIAL, decide=org.decide, evolve=org.evolve)
CREATED = OrgCreated(at=NOW - timedelta(days=1), actor="admin", name="acme")


def test_forgetting_a_workspace_revokes_every_teams_grant_on_it_and_no_other() -> None:
    net = tm.TeamSet(at=NOW, actor="admin", name="net")
    ops = tm.TeamSet(at=NOW, actor="admin", name="ops")
    on_prod = [
        tm.AccessGranted(at=NOW, actor="admin", team=t, target="workspace:prod", level="write")
        for t in ("net", "ops")
    ]
    on_dev = tm.AccessGranted(
        at=NOW, actor="admin", team="net", target="workspace:dev", level="read"
    )
    forget = tm.ForgetWorkspace(actor="admin", workspace="prod")
    after = (
        given(ORG, CREATED, net, ops, *on_prod, on_dev)
        .when(forget)
        .then(
            *[
                tm.AccessRevoked(
                    at=NOW, actor="admin", team=t, target="workspace:prod", reason=tm.PURGED
                )
                for t in ("net", "ops")
            ]
        )
    )
    assert after.teams["net"].access == {"workspace:dev": "read"}
    given(ORG, CREATED, net).when(forget).then_nothing()  # nothing granted: nothing recorded


async def test_a_grant_on_a_purged_workspace_does_not_pass_to_one_made_again_under_its_name(
    http: Http,
) -> None:
    """Team `t` holds write on `prod`; `prod` is deleted and purged, and made again: `t`'s
    member finds the new `prod` not at all (404), its access list names owners alone, and
    the organization's events folded afresh (a replay) say the same. On main the new
    `prod` answered 200 and listed `t` at write."""
    await http.org("a")
    await http.workspace("a", "prod")
    token = await person(http, "a", "tom@a.io", "t", **{"workspaces/prod": "write"})
    assert (await http.get(f"{V1}/a/workspaces/prod", token=token)).status == 200
    assert (await http.call("DELETE", f"{V1}/a/workspaces/prod")).status == 204
    assert (await http.post(f"{V1}/a/workspaces/prod/purge")).status == 204
    await http.workspace("a", "prod")

    (await http.get(f"{V1}/a/workspaces/prod", token=token)).problem("not-found", 404)
    run = await http.post(f"{V1}/a/workspaces/prod/runs", json={"type": "apply"}, token=token)
    run.problem("not-found", 404)
    who = await http.get("/api/v1/whoami", token=token)
    assert "prod" not in who.body["access"]["workspaces"], who.body
    listed = await http.get(f"{V1}/a/workspaces/prod/access")
    assert listed.body["items"] == [{"team": "owners", "level": "admin"}], listed.body

    history = [e.event for e in await http.app.store.read(org_subject("a"))]
    replayed = org.fold([e for e in history if isinstance(e, org.OrgEvent)])
    assert "workspace:prod" not in replayed.teams["t"].access
    live = (await http.app.load_org("a")).state
    assert replayed.teams == live.teams
    found = access.for_teams("a", "tom@a.io", [replayed.teams["t"]])
    assert found.level_on(access.Target(org="a", workspace="prod")) == access.NONE


async def test_a_deleted_or_missing_workspace_takes_no_grant_through_the_api_or_the_ui(
    http: Http,
) -> None:
    """A grant on a deleted workspace would outlive it the moment it is purged: 409
    `workspace-deleted`. The UI's grant form, which on main wrote a grant on any name
    (one made before its workspace, held by whatever is later created under it), goes
    through the same check (`grants.grant`). A revocation is always taken."""
    await http.org("a")
    await http.workspace("a", "prod")
    assert (await http.post(f"{V1}/a/teams", json={"name": "t"})).status == 201
    assert (await http.call("DELETE", f"{V1}/a/workspaces/prod")).status == 204
    put = {"team": "t", "level": "write"}
    a = await http.call("PUT", f"{V1}/a/workspaces/prod/access", json=put)
    a.problem("workspace-deleted", 409)
    for name in ("prod", "later"):  # the UI's path: deleted, and not made yet
        cmd = tm.GrantAccess(actor="admin", team="t", target=f"workspace:{name}", level="read")
        with pytest.raises(Problem) as refused:
            await grants.grant(http.api, "a", cmd)
        assert refused.value.slug == ("workspace-deleted" if name == "prod" else "not-found")
    none = {"team": "t", "level": "none"}
    assert (await http.call("PUT", f"{V1}/a/workspaces/prod/access", json=none)).status == 200
    assert "workspace:prod" not in (await http.app.load_org("a")).state.teams["t"].access


def test_a_revocation_recorded_before_reasons_reads_as_an_admins() -> None:
    """`org.access_revoked` as main wrote it (no `reason`) decodes, reason "", and folds
    as before; the purge's carries its reason."""
    old = b'{"type":"org.access_revoked","at":"2026-01-01T00:00:00Z","actor":"admin",'
    old += b'"team":"net","target":"workspace:prod"}'
    event = decode(old)
    assert isinstance(event, tm.AccessRevoked) and event.reason == ""
    purged = tm.AccessRevoked(
        at=NOW, actor="admin", team="net", target="workspace:prod", reason=tm.PURGED
    )
    assert decode(encode(purged)) == purged
