"""The one access check (events/access.py) as a table of levels x actions, and the people
and teams it reads (events/members.py, events/teams.py), given / when / then. No I/O."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import msgspec
import pytest

from events import access, org
from events import members as mb
from events import teams as tm
from events.access import Target, allowed
from events.errors import AlreadyExists, Forbidden, Invalid, NotFound
from events.org import IssueToken, OrgCreated, SignInUser, TokenIssued, TokenRevoked
from tests.gwt import NOW, Aggregate, given

ORG = Aggregate(initial=org.INITIAL, decide=org.decide, evolve=org.evolve)
CREATED = OrgCreated(at=NOW - timedelta(days=1), actor="admin", name="acme")
LEVELS = ("none", "read", "plan", "write", "admin")
WS = Target(org="acme", workspace="net", folders=("infra", "prod"))
OTHER_WS = Target(org="acme", workspace="db", folders=())
ORG_T = Target(org="acme")

# The table, written out (not derived from the code it checks): the least level on a
# workspace each workspace action needs, and for organization actions the right that
# grants it ("" when only admin on the organization does; None: any caller of the org).
WORKSPACE_ACTIONS = {
    "workspace.read": "read",
    "run.plan": "plan",
    "run.cancel_plan": "plan",
    "state.read": "plan",
    "run.apply": "write",
    "run.approve": "write",
    "run.cancel": "write",
    "workspace.lock": "write",
    "variables.write": "write",
    "state.write": "write",
    "state.rollback": "admin",
    "schedules.write": "write",
    "workspace.force_unlock": "admin",
    "workspace.settings": "admin",
    "workspace.access": "admin",
    "workspace.delete": "admin",
}
ORG_ACTIONS: dict[str, str | None] = {
    "org.read": None,
    "tokens.personal": None,
    "workspaces.create": "manage-workspaces",
    "folders.create": "manage-workspaces",
    "policies.manage": "manage-policies",
    "vcs.manage": "manage-vcs",
    "teams.manage": "manage-teams",
    "audit.read": "read-audit",
    "org.settings": "",
    "org.access": "",
}


def team_access(grants: dict[str, str], rights: tuple[str, ...] = ()) -> access.Access:
    team = tm.Team(name="t", rights=rights, access=grants)
    return access.for_teams("acme", "alice@acme.io", [team])


def test_the_table_names_every_action_the_check_knows() -> None:
    assert set(access.ACTIONS) == set(WORKSPACE_ACTIONS) | set(ORG_ACTIONS) | {"org.create"}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("action", sorted(WORKSPACE_ACTIONS))
def test_a_workspace_grant_allows_exactly_the_actions_at_or_below_its_level(
    level: str, action: str
) -> None:
    who = team_access({"workspace:net": level} if level != "none" else {})
    expected = LEVELS.index(level) >= LEVELS.index(WORKSPACE_ACTIONS[action])
    assert allowed(who, action, WS) is expected
    assert allowed(who, action, OTHER_WS) is False  # another workspace: nothing


@pytest.mark.parametrize("level", LEVELS[1:])
@pytest.mark.parametrize("action", sorted(WORKSPACE_ACTIONS))
def test_a_folder_grant_holds_for_workspaces_in_it_and_in_folders_below(
    level: str, action: str
) -> None:
    who = team_access({"folder:infra": level})  # net sits in infra/prod
    expected = LEVELS.index(level) >= LEVELS.index(WORKSPACE_ACTIONS[action])
    assert allowed(who, action, WS) is expected
    assert allowed(who, action, Target(org="acme", folders=("infra",))) is expected
    assert allowed(who, action, OTHER_WS) is False


@pytest.mark.parametrize("level", LEVELS[1:])
@pytest.mark.parametrize("action", sorted(ORG_ACTIONS))
def test_organization_actions_need_admin_on_it_or_their_right(level: str, action: str) -> None:
    right = ORG_ACTIONS[action]
    on_org = team_access({"org": level})
    on_ws = team_access({"workspace:net": "admin"})
    assert allowed(on_org, action, ORG_T) is (right is None or level == "admin")
    assert allowed(on_ws, action, ORG_T) is (right is None)
    if right:
        assert allowed(team_access({}, (right,)), action, ORG_T)


@pytest.mark.parametrize("role", org.ROLES)
@pytest.mark.parametrize("action", sorted(WORKSPACE_ACTIONS))
def test_role_tokens_keep_working_as_levels_on_the_whole_organization(
    role: str, action: str
) -> None:
    level = {"viewer": "read", "operator": "write", "approver": "write", "admin": "admin"}[role]
    who = access.for_role("acme", "ci", role)
    expected = LEVELS.index(level) >= LEVELS.index(WORKSPACE_ACTIONS[action])
    assert allowed(who, action, WS) is expected
    assert allowed(who, action, OTHER_WS) is expected


def test_another_organization_is_not_found_whatever_the_level() -> None:
    who = access.for_role("acme", "ci", "admin")
    theirs = Target(org="beta", workspace="net")
    for action in access.ACTIONS:
        assert not allowed(who, action, theirs)
    with pytest.raises(NotFound, match="organization beta"):
        access.require(who, "workspace.read", theirs)


def test_a_workspace_beyond_read_is_not_found_and_a_missing_level_is_forbidden() -> None:
    who = team_access({"workspace:net": "plan"})
    with pytest.raises(NotFound, match="run r-1 not found"):
        access.require(who, "workspace.read", OTHER_WS, hidden="run r-1")
    with pytest.raises(Forbidden, match=r"has plan on workspace net; run\.apply needs write"):
        access.require(who, "run.apply", WS)
    access.require(who, "run.plan", WS)


def test_the_deployment_admin_does_everything_and_only_it_creates_organizations() -> None:
    boss = access.superuser("admin")
    assert all(allowed(boss, a, WS) for a in access.ACTIONS)
    assert not allowed(access.for_role("acme", "ci", "admin"), "org.create", ORG_T)


def test_a_personal_tokens_ceiling_caps_its_users_access_and_rights() -> None:
    team = tm.Team(name="ops", rights=("manage-teams",), members=("u-1",), access={"org": "admin"})
    member = mb.Member(user_id="u-1", email="a@acme.io", name="a")
    capped = access.for_member("acme", member, {"ops": team}, cap="plan")
    assert capped is not None
    assert allowed(capped, "run.plan", WS) and not allowed(capped, "run.apply", WS)
    assert not allowed(capped, "teams.manage", ORG_T)


def test_manage_workspaces_is_admin_on_every_workspace_and_folder() -> None:
    who = team_access({}, ("manage-workspaces",))
    assert allowed(who, "workspace.delete", WS) and allowed(who, "workspace.access", OTHER_WS)
    assert not allowed(who, "org.settings", ORG_T)


# ---------------------------------------------------------------- the organization's people

ALICE = mb.user_id_of("Alice@Acme.IO")
INVITED = mb.UserAdded(at=NOW, actor="admin", user_id=ALICE, email="alice@acme.io", name="Al")
NET = tm.TeamSet(at=NOW, actor="admin", name="net", idp_groups=["g-net"])


def people(*events: Any) -> org.OrgState:
    return ORG.fold([CREATED, *events])


def test_a_users_id_is_their_case_folded_email_in_every_organization() -> None:
    assert mb.user_id_of(" ALICE@acme.io") == ALICE == mb.user_id_of("alice@ACME.io")
    given(ORG, CREATED, INVITED).when(
        mb.InviteUser(actor="admin", email="ALICE@acme.io")
    ).then_error(AlreadyExists)
    given(ORG, CREATED).when(mb.InviteUser(actor="admin", email="no-at")).then_error(Invalid)


def test_a_suspended_user_has_no_access_and_their_personal_tokens_none_either() -> None:
    grant = tm.AccessGranted(at=NOW, actor="admin", team="net", target="org", level="admin")
    members = tm.TeamMembersSet(at=NOW, actor="admin", name="net", members=[ALICE])
    state = people(INVITED, NET, grant, members)
    who = access.for_member("acme", state.members[ALICE], state.teams)
    assert who is not None and allowed(who, "workspace.delete", WS) and who.teams == ("net",)
    suspended = ORG.fold([mb.UserSuspended(at=NOW, actor="admin", user_id=ALICE)], state)
    assert access.for_member("acme", suspended.members[ALICE], suspended.teams) is None
    issue = IssueToken(actor="admin", token_id="t", token_hash="h", kind="user", owner=ALICE)
    given(ORG, CREATED, INVITED, mb.UserSuspended(at=NOW, actor="x", user_id=ALICE)).when(
        issue
    ).then_error(mb.Suspended)


def test_a_team_loses_access_at_once_when_its_grant_is_revoked() -> None:
    granted = tm.AccessGranted(
        at=NOW, actor="admin", team="net", target="workspace:net", level="write"
    )
    members = tm.TeamMembersSet(at=NOW, actor="admin", name="net", members=[ALICE])
    state = people(INVITED, NET, granted, members)
    revoke = tm.GrantAccess(actor="admin", team="net", target="workspace:net", level="none")
    after = (
        given(ORG, CREATED, INVITED, NET, granted, members)
        .when(revoke)
        .then(tm.AccessRevoked(at=NOW, actor="admin", team="net", target="workspace:net"))
    )
    before = access.for_member("acme", state.members[ALICE], state.teams)
    now = access.for_member("acme", after.members[ALICE], after.teams)
    assert before is not None and allowed(before, "run.apply", WS)
    assert now is not None and not allowed(now, "workspace.read", WS)


def test_grants_name_an_existing_team_and_folder_and_owners_take_none() -> None:
    g = given(ORG, CREATED, NET)
    g.when(tm.GrantAccess(actor="a", team="nope", target="org", level="read")).then_error(NotFound)
    g.when(tm.GrantAccess(actor="a", team="net", target="folder:x", level="read")).then_error(
        NotFound
    )
    g.when(tm.GrantAccess(actor="a", team="net", target="org", level="boss")).then_error(Invalid)
    g.when(tm.GrantAccess(actor="a", team="owners", target="org", level="read")).then_error(Invalid)
    g.when(tm.DeleteTeam(actor="a", name="owners")).then_error(Invalid)


def test_a_deleted_teams_tokens_are_revoked_with_it() -> None:
    issued = TokenIssued(
        at=NOW, actor="a", token_id="t1", token_hash="h", user="team:net", role="",
        kind="team", owner="net",
    )  # fmt: skip
    given(ORG, CREATED, NET, issued).when(tm.DeleteTeam(actor="a", name="net")).then(
        tm.TeamDeleted(at=NOW, actor="a", name="net"),
        TokenRevoked(at=NOW, actor="a", token_id="t1"),
    )


def test_sign_in_adds_the_user_links_their_identity_and_syncs_their_teams() -> None:
    cmd = SignInUser(
        actor="sso", email="Bob@Acme.io", name="Bob", groups=["g-net", "g-x"],
        issuer="https://idp", subject="123",
    )  # fmt: skip
    bob = mb.user_id_of("bob@acme.io")
    state = (
        given(ORG, CREATED, NET)
        .when(cmd)
        .then(
            mb.UserAdded(
                at=NOW, actor="sso", user_id=bob, email="bob@acme.io", name="Bob", via="sso"
            ),
            mb.UserLinked(at=NOW, actor="sso", user_id=bob, issuer="https://idp", subject="123"),
            tm.UserTeamsSynced(at=NOW, actor="sso", user_id=bob, teams=["net"]),
        )
    )
    assert tm.teams_of(state.teams, bob) == ["net"]
    assert decide(state, cmd) == []  # the same sign-in again: nothing new
    dropped = decide(state, msgspec.structs.replace(cmd, groups=[]))
    assert dropped == [tm.UserTeamsSynced(at=NOW, actor="sso", user_id=bob, teams=[])]
    with pytest.raises(mb.IdentityMismatch):  # the same email, another identity
        decide(state, msgspec.structs.replace(cmd, subject="666"))
    suspended = ORG.fold([mb.UserSuspended(at=NOW, actor="a", user_id=bob)], state)
    with pytest.raises(mb.Suspended):
        decide(suspended, cmd)


def decide(state: org.OrgState, cmd: Any) -> list[Any]:
    return ORG.decide(state, cmd, now=NOW, new_id=lambda: "x")
