"""Users and teams of an organization (events/members.py, events/teams.py), read from the
organization's aggregate, so a change shows at once.

Who may: anyone of the organization reads them (a team's grants on workspaces the
reader may not read left out); `manage-teams` invites, suspends and reactivates users,
creates and deletes teams and sets their members; organization rights on a team,
`owners`' members and which identity provider groups map to a team (`idp_groups`, as
single sign-on's configuration) are for admins of the organization (`org.access`). A
right held is not a way to more: a `manage-teams` holder changes the members of (or
mints a token of, or suspends or reactivates a member of) only what holds no more than
it holds itself (events/access.py `beyond`), and never adds itself to a team.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import msgspec
from aiohttp import web

from events import access
from events import members as mb
from events import teams as tm
from events.errors import Forbidden
from events.org import OrgState
from services.surfaces.api.auth import Principal
from services.surfaces.api.bodies import Body, Name, check_name, read_body
from services.surfaces.api.common import (
    Row,
    command_answer,
    items,
    json_response,
    may_read,
    org_state,
    path_id,
    scope,
)
from services.surfaces.api.context import Api
from services.surfaces.api.paths import ORG
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import (
    REF,
    STR,
    Doc,
    list_of,
    operation,
    path_param,
    problems,
)

PREFIX = "/api/v1/orgs"
Email = Annotated[str, msgspec.Meta(min_length=3, max_length=mb.MAX_EMAIL)]
Text = Annotated[str, msgspec.Meta(max_length=mb.MAX_NAME)]
Rights = Annotated[list[str], msgspec.Meta(max_length=len(tm.RIGHTS), description="org rights")]
Groups = Annotated[
    list[Annotated[str, msgspec.Meta(min_length=1, max_length=255)]],
    msgspec.Meta(max_length=tm.MAX_GROUPS, description="the identity provider's groups"),
]
UserRefs = Annotated[
    list[Annotated[str, msgspec.Meta(min_length=1, max_length=mb.MAX_EMAIL)]],
    msgspec.Meta(max_length=tm.MAX_MEMBERS, description="user ids or emails"),
]


class InviteBody(Body, frozen=True, kw_only=True):
    email: Email
    name: Text = ""


class SuspendBody(Body, frozen=True, kw_only=True):
    reason: Annotated[str, msgspec.Meta(max_length=500)] = ""


class TeamBody(Body, frozen=True, kw_only=True):
    name: Name
    rights: Rights = []
    idp_groups: Groups = []


class TeamPatchBody(Body, frozen=True, kw_only=True):
    rights: Rights | None = None
    idp_groups: Groups | None = None


class MembersBody(Body, frozen=True, kw_only=True):
    members: UserRefs


def user_row(state: OrgState, member: mb.Member) -> Row:
    return {
        "id": member.user_id,
        "email": member.email,
        "name": member.name,
        "state": member.state,
        "via": member.via,
        "issuer": member.issuer or None,
        "teams": tm.teams_of(state.teams, member.user_id),
    }


def team_row(state: OrgState, name: str, shown: Callable[[str], bool] = lambda _: True) -> Row:
    """A team as answered; `shown(target)`: whether the reader may see a grant's target
    (a workspace it may not read is not named to it, as everywhere else)."""
    team = tm.with_owners(state.teams)[name]
    emails = {m.user_id: m.email for m in state.members.values()}
    grants = sorted((k, v) for k, v in team.access.items() if shown(k))
    return {
        "name": team.name,
        "rights": list(team.rights),
        "idp_groups": list(team.idp_groups),
        "members": [{"id": u, "email": emails.get(u, "")} for u in team.members],
        "synced": [{"id": u, "email": emails.get(u, "")} for u in team.synced],
        "access": [{"target": k, "level": v} for k, v in grants],
    }


async def grants_shown(api: Api, who: Principal, org: str) -> Callable[[str], bool]:
    """Which grant targets `who` may see: all to a reader of every workspace; else the
    organization, folders and the workspaces it may read."""
    if who.access.uniform(access.READ):
        return lambda _: True
    folders = await api.read.workspaces.folders(org)

    def shown(key: str) -> bool:
        kind, _, ws = key.partition(":")
        return kind != "workspace" or may_read(who, org, ws, folders.get(ws, ""))

    return shown


async def hand_out(
    api: Api, who: Principal, state: OrgState, other: access.Access, what: str
) -> None:
    """Forbidden unless the caller is an admin of the organization or holds everything
    `other` holds (a team's members, a team token, a user suspended or reactivated)."""
    if who.may("org.access", access.Target(org=state.name)):
        return
    more = access.beyond(who.access, other, await api.read.workspaces.folders(state.name))
    if more:
        raise Forbidden(
            f"{who.user} may not {what}: that holds {more}, which {who.user} does not "
            "(an organization admin may)"
        )


async def check_members(
    api: Api, who: Principal, state: OrgState, name: str, members: list[str]
) -> None:
    """Whether the caller may set team `name`'s members to `members` (user ids): not a
    team above it, never itself into a team it is not in (an approvers rule may name the
    team), unless it is an admin of the organization."""
    team = state.teams.get(name)
    if team is None or who.may("org.access", access.Target(org=state.name)):
        return  # a missing team: the core's 404
    what = f"set the members of team {name}"
    await hand_out(api, who, state, access.of_team(state.name, team, state.folders), what)
    mine = who.access.user_id
    if mine and mine in members and not team.has(mine):
        raise Forbidden(
            f"{who.user} may not add themselves to team {name} (an organization admin may)"
        )


async def check_standing(api: Api, who: Principal, state: OrgState, user_id: str) -> None:
    """Suspending or reactivating a user who holds more than the caller (an owner, an
    admin through a team) is an organization admin's."""
    member = state.members.get(user_id)
    if member is None:
        return  # the core's 404
    mine = [t for t in tm.with_owners(state.teams).values() if t.has(user_id)]
    theirs = access.inherited(access.for_teams(state.name, member.email, mine), state.folders)
    await hand_out(api, who, state, theirs, f"change the standing of {member.email}")


def _user_id(state: OrgState, ref: str) -> str:
    """A user id from an id or an email (an unknown email's id: refused by the core)."""
    return ref if ref.startswith("u-") else mb.user_id_of(ref) if "@" in ref else ref


# ---------------------------------------------------------------- users


async def list_users(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "org.read")
    state = await org_state(api, org)
    return items([user_row(state, m) for m in state.members.values()])


async def get_user(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "org.read")
    state = await org_state(api, org)
    return json_response(user_row(state, mb.known(state.members, path_id(request, "user"))))


async def invite_user(request: web.Request) -> web.Response:
    """POST .../users {"email", "name"}: a user of the organization (409 if one)."""
    api, org, who = await scope(request, "teams.manage")
    body = await read_body(request, InviteBody)
    await org_state(api, org)
    cmd = mb.InviteUser(actor=who.user, email=body.email, name=body.name)
    result = await api.app.org_command(org, cmd)
    user_id = result.events[-1].user_id
    row = user_row(result.state, result.state.members[user_id])
    where = f"{PREFIX}/{org}/users/{user_id}"
    return command_answer(row, result.seq, status=201, location=where)


async def suspend_user(request: web.Request) -> web.Response:
    """POST .../users/{user}/suspend: every token and session of theirs in this
    organization is refused from the answer on, on every replica."""
    api, org, who = await scope(request, "teams.manage")
    user_id = path_id(request, "user")
    body = await read_body(request, SuspendBody, optional=True)
    state = await org_state(api, org)
    await check_standing(api, who, state, user_id)
    cmd = mb.SuspendUser(actor=who.user, user_id=user_id, reason=body.reason)
    result = await api.app.org_command(org, cmd)
    await api.after_write(result.seq)
    return command_answer(user_row(result.state, result.state.members[user_id]), result.seq)


async def reactivate_user(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "teams.manage")
    user_id = path_id(request, "user")
    state = await org_state(api, org)
    await check_standing(api, who, state, user_id)
    result = await api.app.org_command(org, mb.ReactivateUser(actor=who.user, user_id=user_id))
    return command_answer(user_row(result.state, result.state.members[user_id]), result.seq)


# ---------------------------------------------------------------- teams


async def list_teams(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.read")
    state = await org_state(api, org)
    shown = await grants_shown(api, who, org)
    return items([team_row(state, name, shown) for name in sorted(tm.with_owners(state.teams))])


async def get_team(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.read")
    state = await org_state(api, org)
    name = path_id(request, "team")
    if name not in tm.with_owners(state.teams):
        raise Problem("not-found", f"team {name} not found")
    return json_response(team_row(state, name, await grants_shown(api, who, org)))


async def create_team(request: web.Request) -> web.Response:
    """POST .../teams {"name", "rights", "idp_groups"}: rights need an org admin."""
    await scope(request, "org.read")  # another organization: 404 before its body
    body = await read_body(request, TeamBody)
    admin = body.rights or body.idp_groups  # rights and the groups' mapping: an admin's
    api, org, who = await scope(request, "org.access" if admin else "teams.manage")
    name = check_name("name", body.name)
    await org_state(api, org)
    cmd = tm.SetTeam(
        actor=who.user, name=name, rights=list(body.rights), idp_groups=list(body.idp_groups)
    )
    result = await api.app.org_command(org, cmd)
    where = f"{PREFIX}/{org}/teams/{name}"
    return command_answer(team_row(result.state, name), result.seq, status=201, location=where)


async def patch_team(request: web.Request) -> web.Response:
    """PATCH .../teams/{team} {"rights"?, "idp_groups"?}: each given replaces."""
    api, org, who = await scope(request, "teams.manage")
    body = await read_body(request, TeamPatchBody)
    name = path_id(request, "team")
    state = await org_state(api, org)
    team = state.teams.get(name)
    if team is None or name == tm.OWNERS:
        raise Problem("not-found" if team is None else "invalid-command", f"team {name}")
    rights = list(team.rights) if body.rights is None else list(body.rights)
    if set(rights) != set(team.rights):
        await scope(request, "org.access")
    groups = list(team.idp_groups) if body.idp_groups is None else list(body.idp_groups)
    if groups != list(team.idp_groups):
        await scope(request, "org.access")
    cmd = tm.SetTeam(actor=who.user, name=name, rights=rights, idp_groups=groups, create=False)
    result = await api.app.org_command(org, cmd)
    return command_answer(team_row(result.state, name), result.seq)


async def delete_team(request: web.Request) -> web.Response:
    """DELETE .../teams/{team}: its grants, members and tokens go with it."""
    api, org, who = await scope(request, "teams.manage")
    name = path_id(request, "team")
    await org_state(api, org)
    result = await api.app.org_command(org, tm.DeleteTeam(actor=who.user, name=name))
    await api.after_write(result.seq)
    return web.Response(status=204, headers={"RP-Seq": str(result.seq)})


async def set_members(request: web.Request) -> web.Response:
    """PUT .../teams/{team}/members {"members": [id or email]}: replaces those an admin
    set (single sign-on's synced members stay). `owners` is for admins of the org."""
    name = path_id(request, "team")
    api, org, who = await scope(request, "org.access" if name == tm.OWNERS else "teams.manage")
    body = await read_body(request, MembersBody)
    state = await org_state(api, org)
    members = [_user_id(state, m) for m in body.members]
    await check_members(api, who, state, name, members)
    cmd = tm.SetTeamMembers(actor=who.user, name=name, members=members)
    result = await api.app.org_command(org, cmd)
    await api.after_write(result.seq)
    return command_answer(team_row(result.state, name), result.seq)


# ---------------------------------------------------------------- OpenAPI

_USER: Doc = {
    "type": "object",
    "required": ["id", "email", "name", "state", "via", "issuer", "teams"],
    "properties": {
        "id": STR,
        "email": STR,
        "name": STR,
        "state": {"enum": ["active", "suspended"]},
        "via": {"enum": ["invitation", "sso"]},
        "issuer": {"anyOf": [STR, {"type": "null"}]},
        "teams": {"type": "array", "items": STR},
    },
}
_PERSON: Doc = {"type": "object", "properties": {"id": STR, "email": STR}}
_TEAM: Doc = {
    "type": "object",
    "required": ["name", "rights", "idp_groups", "members", "synced", "access"],
    "properties": {
        "name": STR,
        "rights": {"type": "array", "items": {"enum": list(tm.RIGHTS)}},
        "idp_groups": {"type": "array", "items": STR},
        "members": {"type": "array", "items": _PERSON},
        "synced": {"type": "array", "items": _PERSON},
        "access": {
            "type": "array",
            "items": {"type": "object", "properties": {"target": STR, "level": STR}},
        },
    },
}
_BODIES = (InviteBody, SuspendBody, TeamBody, TeamPatchBody, MembersBody)
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components(_BODIES, ref_template=REF)[1],
    "User": _USER,
    "UserList": list_of("User"),
    "Team": _TEAM,
    "TeamList": list_of("Team"),
}
PARAMETERS: dict[str, Doc] = {
    "user": path_param("user", "user id"),
    "team": path_param("team", "team name"),
}


def _op(
    op_id: str, summary: str, answer: tuple[int, str], params: tuple[str, ...], body: str = ""
) -> Doc:
    errors = (400, 401, 403, 404, 409, 422) if body else (401, 404)
    return operation(op_id, summary, answer, params=params, body=body, errors=errors)


_U, _T = f"{PREFIX}/{{org}}/users", f"{PREFIX}/{{org}}/teams"
PATHS: dict[str, Doc] = {
    _U: {
        "get": _op("listUsers", "The organization's users", (200, "UserList"), ("org",)),
        "post": _op("inviteUser", "Invite a user", (201, "User"), ("org",), "InviteBody"),
    },
    _U + "/{user}": {"get": _op("getUser", "A user", (200, "User"), ("org", "user"))},
    _U + "/{user}/suspend": {
        "post": _op(
            "suspendUser",
            "Suspend a user: their tokens and sessions end at once",
            (200, "User"),
            ("org", "user"),
            "SuspendBody",
        )
    },
    _U + "/{user}/reactivate": {
        "post": _op("reactivateUser", "Reactivate a user", (200, "User"), ("org", "user"))
    },
    _T: {
        "get": _op("listTeams", "The organization's teams", (200, "TeamList"), ("org",)),
        "post": _op("createTeam", "Create a team", (201, "Team"), ("org",), "TeamBody"),
    },
    _T + "/{team}": {
        "get": _op("getTeam", "A team", (200, "Team"), ("org", "team")),
        "patch": _op("patchTeam", "Change a team", (200, "Team"), ("org", "team"), "TeamPatchBody"),
        "delete": {
            "operationId": "deleteTeam",
            "summary": "Delete a team: its grants, members and tokens go with it",
            "parameters": [{"$ref": f"#/components/parameters/{p}"} for p in ("org", "team")],
            "responses": {"204": {"description": "deleted"}, **problems(401, 403, 404, 422)},
        },
    },
    _T + "/{team}/members": {
        "put": _op("setTeamMembers", "Set members", (200, "Team"), ("org", "team"), "MembersBody")
    },
}

ROUTES = [
    web.get(ORG + "/users", list_users, allow_head=False),
    web.post(ORG + "/users", invite_user),
    web.get(ORG + "/users/{user}", get_user, allow_head=False),
    web.post(ORG + "/users/{user}/suspend", suspend_user),
    web.post(ORG + "/users/{user}/reactivate", reactivate_user),
    web.get(ORG + "/teams", list_teams, allow_head=False),
    web.post(ORG + "/teams", create_team),
    web.get(ORG + "/teams/{team}", get_team, allow_head=False),
    web.patch(ORG + "/teams/{team}", patch_team),
    web.delete(ORG + "/teams/{team}", delete_team),
    web.put(ORG + "/teams/{team}/members", set_members),
]
