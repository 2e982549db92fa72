"""`/orgs/{org}/people`: users and teams (invite, suspend, reactivate, team members);
`/orgs/{org}/folders/{folder}`: a folder's workspaces and access; the access forms of the
folder and workspace pages. Each form is checked by the one access check
(events/access.py) as the API's routes are, and does what they do."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from events import members as mb
from events import teams as tm
from services.surfaces.api import grants
from services.surfaces.api.people import (
    check_members,
    check_standing,
    grants_shown,
    team_row,
    user_row,
)
from services.surfaces.api.problems import Problem
from services.surfaces.ui.web import FORM, Visit, base, form, page, render, see_other


def _field(visit: Visit, name: str, limit: int = 254) -> str:
    value = visit.request[FORM].get(name, "")
    if not isinstance(value, str) or len(value) > limit:
        raise Problem("invalid-body", f"{name} is at most {limit} characters")
    return value.strip()


@page("org.read")
async def people_page(visit: Visit) -> web.StreamResponse:
    """Users and teams of the organization, and the forms the caller may use."""
    state = (await visit.api.app.load_org(visit.org)).state
    users = [user_row(state, m) for m in state.members.values()]
    shown = await grants_shown(visit.api, visit.who, visit.org)
    teams = [team_row(state, name, shown) for name in sorted(tm.with_owners(state.teams))]
    context: dict[str, Any] = await base(visit, users=users, teams=teams)
    return render(visit.request, "people.html", context)


@form("teams.manage")
async def invite(visit: Visit) -> web.StreamResponse:
    cmd = mb.InviteUser(
        actor=visit.who.user, email=_field(visit, "email"), name=_field(visit, "name")
    )
    result = await visit.api.app.org_command(visit.org, cmd)
    await visit.api.after_write(result.seq)
    return see_other(f"/orgs/{visit.org}/people")


async def _user_state(visit: Visit, suspend: bool) -> web.StreamResponse:
    user_id = _field(visit, "user", 64)
    state = (await visit.api.app.load_org(visit.org)).state
    await check_standing(visit.api, visit.who, state, user_id)  # nobody above the caller
    cmd: mb.SuspendUser | mb.ReactivateUser
    if suspend:
        cmd = mb.SuspendUser(actor=visit.who.user, user_id=user_id)
    else:
        cmd = mb.ReactivateUser(actor=visit.who.user, user_id=user_id)
    result = await visit.api.app.org_command(visit.org, cmd)
    await visit.api.after_write(result.seq)
    return see_other(f"/orgs/{visit.org}/people")


@form("teams.manage")
async def suspend(visit: Visit) -> web.StreamResponse:
    """Suspend: every token and session of the user ends at once, on every replica."""
    return await _user_state(visit, True)


@form("teams.manage")
async def reactivate(visit: Visit) -> web.StreamResponse:
    return await _user_state(visit, False)


@form("teams.manage")
async def team_members(visit: Visit) -> web.StreamResponse:
    """Create the team if new, and set its members (emails, one a line or comma)."""
    name = _field(visit, "team", 63)
    if name == tm.OWNERS:
        visit.require("org.access")
    raw = _field(visit, "members", 100_000).replace(",", "\n")
    members = [
        mb.user_id_of(e) if "@" in e else e for e in (x.strip() for x in raw.split("\n")) if e
    ]
    state = (await visit.api.app.load_org(visit.org)).state
    await check_members(visit.api, visit.who, state, name, members)  # as the API's
    if name not in tm.with_owners(state.teams):
        await visit.api.app.org_command(visit.org, tm.SetTeam(actor=visit.who.user, name=name))
    cmd = tm.SetTeamMembers(actor=visit.who.user, name=name, members=members)
    result = await visit.api.app.org_command(visit.org, cmd)
    await visit.api.after_write(result.seq)
    return see_other(f"/orgs/{visit.org}/people")


@page("workspace.read")
async def folder_page(visit: Visit) -> web.StreamResponse:
    """A folder's workspaces and the teams' access on it."""
    folder = visit.path_id("folder")
    state = (await visit.api.app.load_org(visit.org)).state
    if folder not in state.folders:
        raise Problem("not-found", f"folder {folder} not found")
    folders = await visit.api.read.workspaces.folders(visit.org)
    inside = sorted(ws for ws, f in folders.items() if f == folder and visit.may_read(ws, f))
    key = f"folder:{folder}"
    grants = [
        {"team": t.name, "level": t.access[key]} for t in state.teams.values() if key in t.access
    ]
    context = await base(visit, folder=folder, workspaces=inside, grants=grants, levels=tm.LEVELS)
    return render(visit.request, "folder.html", context)


@form("workspace.access")
async def grant(visit: Visit) -> web.StreamResponse:
    """The access form of a workspace's or a folder's page."""
    match = visit.request.match_info
    kind, name = ("workspace", match["ws"]) if "ws" in match else ("folder", match["folder"])
    cmd = tm.GrantAccess(
        actor=visit.who.user,
        team=_field(visit, "team", 63),
        target=f"{kind}:{name}",
        level=_field(visit, "level", 10),
    )
    result = await grants.grant(visit.api, visit.org, cmd)
    await visit.api.after_write(result.seq)
    where = "workspaces" if kind == "workspace" else "folders"
    return see_other(f"/orgs/{visit.org}/{where}/{name}")
