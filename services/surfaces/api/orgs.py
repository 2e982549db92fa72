"""Handlers for organizations, their tokens and their workspaces."""

from __future__ import annotations

from datetime import datetime, timedelta

from aiohttp import web

from events import access
from events.errors import Forbidden, RepositoryRefused
from events.org import OrgState, RevokeToken
from events.run import Workspace
from events.teams import LEVELS, OWNERS
from projections.working import iso
from services.app import repositories
from services.surfaces.api import asof, people, render, secrets, workspaces
from services.surfaces.api import vcs as vcs_api
from services.surfaces.api.auth import PRINCIPAL, Principal
from services.surfaces.api.bodies import (
    MAX_TOKEN_LIFETIME_S,
    CreateOrgBody,
    CreateTokenBody,
    CreateWorkspaceBody,
    UpdateWorkspaceBody,
    check_name,
    check_timeouts,
    read_body,
)
from services.surfaces.api.common import (
    SEQ_HEADER,
    Row,
    items,
    json_response,
    may_read,
    org_state,
    path_id,
    scope,
    written,
)
from services.surfaces.api.context import API, Api
from services.surfaces.api.paths import ORG, V1, WS
from services.surfaces.api.problems import Problem

PREFIX = "/api/v1"
MAX_TOKEN_LIFETIME = timedelta(seconds=MAX_TOKEN_LIFETIME_S)
# The repository sources this API takes (services/app/repositories.py); absent: any.
SOURCES: web.AppKey[repositories.Sources] = web.AppKey("runplane.sources", repositories.Sources)


async def _existing_org(api: Api, org: str) -> Row:
    row = await api.read.orgs.get(org)
    if row is None:
        raise Problem("not-found", f"organization {org} not found")
    return row


async def create_org(request: web.Request) -> web.Response:
    """POST /orgs: the admin token only."""
    if not request[PRINCIPAL].superuser:
        raise Problem("forbidden", "only the admin token may create organizations")
    body = await read_body(request, CreateOrgBody)
    name = check_name("name", body.name)
    api = request.app[API]
    result = await api.app.create_org(name, request[PRINCIPAL].user)
    return await written(
        api,
        result.seq,
        lambda: api.read.orgs.get(name),
        lambda: render.org(result.state, request[PRINCIPAL].user),
        status=201,
        location=f"{PREFIX}/orgs/{name}",
    )


async def get_org(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "org.read")
    return json_response(await _existing_org(api, org))


async def create_token(request: web.Request) -> web.Response:
    """POST /orgs/{org}/tokens: the only answer that ever shows the clear token. An
    organization token needs an org admin; a team token `manage-teams` (owners': an org
    admin); a personal token is its user's own (or an org admin's for another user),
    never above the caller's own ceiling (events/access.py)."""
    api, org, who = await scope(request, "tokens.personal")
    body = await read_body(request, CreateTokenBody, optional=True)
    expires_at = token_expiry(body, api.app.clock())
    owner, level = await _token_rules(request, who, body)
    token, result = await api.app.issue_token(
        org, body.user, body.role if not body.kind else "", who.user,
        expires_at=expires_at, kind=body.kind, owner=owner, level=level,
        name=body.name if body.kind else "",
    )  # fmt: skip
    await api.after_write(result.seq)  # so the token works here at once
    issued = result.events[-1]
    answer = {
        "token": token,
        "token_id": issued.token_id,
        "user": issued.user,
        "role": issued.role,
        "kind": issued.kind or "org",
        "level": issued.level or None,
        "org": org,
        "expires_at": iso(issued.expires_at) if issued.expires_at else None,
    }
    return json_response(answer, status=201, headers={SEQ_HEADER: str(result.seq)})


async def _token_rules(
    request: web.Request, who: Principal, body: CreateTokenBody
) -> tuple[str, str]:
    """Who may make the token asked for; its owner and ceiling."""
    mine = who.access
    match body.kind:
        case "":
            await scope(request, "org.settings")
            return "", ""
        case "team":
            api, org, _ = await scope(
                request, "org.access" if body.team == OWNERS else "teams.manage"
            )
            await _team_token_rule(api, who, await org_state(api, org), body.team)
            return body.team, ""
        case "user":
            owner = body.user_id or mine.user_id
            if not owner:
                raise Problem("invalid-command", "a personal token needs a user: give user_id")
            if owner != mine.user_id:
                await scope(request, "org.access")
            if mine.cap < access.ADMIN:  # a capped token makes no token above its cap
                wanted = LEVELS.index(body.level) if body.level in LEVELS else access.ADMIN
                return owner, LEVELS[min(wanted, mine.cap)]
            return owner, body.level
        case _:
            raise Problem("invalid-command", f"unknown token kind {body.kind!r}")


async def _team_token_rule(api: Api, who: Principal, state: OrgState, name: str) -> None:
    """A team token acts as the team: a `manage-teams` holder mints one only of a team
    it is a member of and that holds no more than it does (an org admin, any)."""
    team = state.teams.get(name)
    if team is None or who.may("org.access", access.Target(org=state.name)):
        return  # a missing team: the core's 404
    what = f"mint a token of team {name}"
    await people.hand_out(api, who, state, access.of_team(state.name, team, state.folders), what)
    if not team.has(who.access.user_id):
        raise Forbidden(f"{who.user} may {what} only as its member (an organization admin may)")


def token_expiry(body: CreateTokenBody, now: datetime) -> datetime | None:
    """When a new token expires: `expires_in` seconds from now, or `expires_at`."""
    if body.expires_in is not None and body.expires_at is not None:
        raise Problem("invalid-command", "give expires_in or expires_at, not both")
    if body.expires_in is not None:
        if not 1 <= body.expires_in <= MAX_TOKEN_LIFETIME_S:
            raise Problem(
                "invalid-command",
                f"expires_in must be between 1 and {MAX_TOKEN_LIFETIME_S} seconds, "
                f"got {body.expires_in}",
            )
        return now + timedelta(seconds=body.expires_in)
    if body.expires_at is not None and body.expires_at > now + MAX_TOKEN_LIFETIME:
        raise Problem("invalid-command", f"expires_at is more than {MAX_TOKEN_LIFETIME} away")
    return body.expires_at  # one in the past is refused by the core (events/org.py)


async def list_tokens(request: web.Request) -> web.Response:
    """GET /orgs/{org}/tokens: the tokens not revoked, never their secret nor its hash:
    all of them to an org admin, team tokens too to `manage-teams`, else the caller's own
    personal tokens."""
    api, org, who = await scope(request, "tokens.personal")
    await _owns_tokens(request, who, org)
    await _existing_org(api, org)
    state = await org_state(api, org)
    now = iso(api.app.clock())
    rows = [r for r in await api.read.orgs.tokens(org) if _visible(who, org, state, r)]
    return items(
        [
            r
            | _kind(state, r)
            | {"expired": r["expires_at"] is not None and r["expires_at"] <= now}
            for r in rows
        ]
    )


async def _owns_tokens(request: web.Request, who: Principal, org: str) -> None:
    """Organization tokens (of before users) own no token: listing and revoking stay an
    org admin's (403 otherwise), as before."""
    if not who.access.user_id and not who.may("teams.manage", access.Target(org=org)):
        await scope(request, "org.settings")


def _kind(state: OrgState, row: Row) -> Row:
    owner = state.owners.get(row["token_id"])
    if owner is None:
        return {"kind": "org", "owner": None, "level": None, "name": None}
    level, name = owner.level or None, owner.name or None
    return {"kind": owner.kind, "owner": owner.owner, "level": level, "name": name}


def _visible(who: Principal, org: str, state: OrgState, row: Row) -> bool:
    """Whether `who` may see (and revoke) the token of `row`."""
    whole = access.Target(org=org)
    if who.may("org.settings", whole):
        return True
    owner = state.owners.get(row["token_id"])
    if owner is None:
        return False
    if owner.kind == "team":
        return owner.owner != OWNERS and who.may("teams.manage", whole)
    return bool(who.access.user_id) and owner.owner == who.access.user_id


async def revoke_token(request: web.Request) -> web.Response:
    """DELETE /orgs/{org}/tokens/{token}: from the answer on, the token is refused on
    every replica (services/surfaces/api/auth.py); revoking it again changes nothing.
    One the caller may not see is not found."""
    api, org, who = await scope(request, "tokens.personal")
    await _owns_tokens(request, who, org)
    token_id = path_id(request, "token")
    state = await org_state(api, org)
    row = {"token_id": token_id}
    if not _visible(who, org, state, row):
        raise Problem("not-found", f"token {token_id} not found")
    result = await api.app.org_command(org, RevokeToken(actor=who.user, token_id=token_id))
    await api.after_write(result.seq)
    return web.Response(status=204, headers={SEQ_HEADER: str(result.seq)})


async def create_workspace(request: web.Request) -> web.Response:
    """POST .../workspaces: `manage-workspaces` (or an org admin), or admin on its folder."""
    api, org, who = await scope(request, "org.read")  # another organization: 404 first
    body = await read_body(request, CreateWorkspaceBody)
    folder = check_name("folder", body.folder) if body.folder else ""
    if not (folder and who.may("workspace.settings", access.Target(org=org, folders=(folder,)))):
        await scope(request, "workspaces.create")
    name = check_name("name", body.name)
    check_timeouts(body)
    check_repository(request, org, body.repository)
    secrets.check_secret_names(body.secret_variables, body.variables)
    if body.secret_variables:
        secrets.store_of(request)  # 503 now, before anything is written, if there is none
    config = Workspace(
        repository=body.repository,
        branch=body.branch,
        directory=body.directory,
        variables=dict(body.variables),
        secret_variables=sorted(body.secret_variables),  # names only: values are sealed
        heartbeat_timeout=body.heartbeat_timeout,
        dispatch_timeout=body.dispatch_timeout,
        managed_state=body.managed_state,
        vcs_connection=check_name("vcs_connection", body.vcs_connection)
        if body.vcs_connection
        else "",
        trigger_paths=list(body.trigger_paths),
        trigger_any_change=body.trigger_any_change,
        trigger_tags=list(body.trigger_tags),
        vcs_run_type=body.vcs_run_type,
    )
    if config.vcs_connection:
        await vcs_api.check_binding(api, org, config.vcs_connection)  # the org's own only
    result = await api.app.create_workspace(org, name, config, who.user, folder=folder)
    await secrets.store_all(request, org, name, body.secret_variables)
    return await secrets.workspace_written(
        request,
        api,
        org,
        name,
        result,
        who.user,
        status=201,
        location=f"{PREFIX}/orgs/{org}/workspaces/{name}",
    )


def check_repository(request: web.Request, org: str, repository: str) -> None:
    """422 `repository-not-allowed`, naming the rule, for a repository the deployment
    does not take for `org`, or one in runplane's own directories or the kernel's."""
    sources = request.app.get(SOURCES)
    if sources is None:
        return
    try:
        sources.check(repository, org=org)
    except RepositoryRefused as e:
        raise Problem("repository-not-allowed", str(e), rule=e.rule) from e


async def update_workspace(request: web.Request) -> web.Response:
    """PATCH .../workspaces/{ws}: its plain variables and configuration members
    (`ws.variables_set`, `ws.config_changed`); runs already created keep theirs."""
    await scope(request, "workspace.read")  # another organization's, or hidden: 404 first
    body = await read_body(request, UpdateWorkspaceBody)
    changes = workspaces.config_changes(body)
    api, org, who = await scope(request, "workspace.settings" if changes else "variables.write")
    ws = path_id(request, "ws")
    if body.variables is None and not changes:
        raise Problem("invalid-command", "nothing to change: give variables or a config member")
    if await api.read.workspaces.get(org, ws) is None:
        raise Problem("not-found", f"workspace {ws} not found")
    if "repository" in changes:
        check_repository(request, org, changes["repository"])
    await workspaces.check_config(api, org, changes)
    result = None
    if changes:
        result = await api.app.change_workspace(org, ws, changes, who.user)
    if body.variables is not None:
        await secrets.check_plain_names(request, org, ws, body.variables)
        result = await api.app.set_variables(org, ws, dict(body.variables), who.user)
    assert result is not None
    return await secrets.workspace_written(request, api, org, ws, result, who.user)


async def list_workspaces(request: web.Request) -> web.Response:
    """GET .../workspaces: the live ones; `?deleted=true` adds those deleted (not purged)."""
    api, org, who = await scope(request, "org.read")
    await _existing_org(api, org)
    deleted = request.query.get("deleted", "false")
    if deleted not in ("true", "false"):
        raise Problem("invalid-query", "deleted must be true or false")
    rows = await api.read.workspaces.find(org, deleted=deleted == "true")
    if not who.access.uniform(access.READ):  # only those the caller may read
        folders = await api.read.workspaces.folders(org)
        rows = [r for r in rows if may_read(who, org, r["name"], folders.get(r["name"], ""))]
    return items(rows)


async def get_workspace(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "workspace.read")
    ws = path_id(request, "ws")
    if asof.asked(request):  # the workspace as answered then (services/surfaces/api/asof.py)
        return await asof.workspace(request, org, ws)
    row = await secrets.workspace_shown(request, api, org, ws)
    if row is None:
        raise Problem("not-found", f"workspace {ws} not found")
    return json_response(row)


ROUTES = [
    web.post(V1 + "/orgs", create_org),
    web.get(ORG, get_org, allow_head=False),
    web.post(ORG + "/tokens", create_token),
    web.get(ORG + "/tokens", list_tokens, allow_head=False),
    web.delete(ORG + "/tokens/{token}", revoke_token),
    web.get(ORG + "/workspaces", list_workspaces, allow_head=False),
    web.post(ORG + "/workspaces", create_workspace),
    web.get(WS, get_workspace, allow_head=False),
    web.patch(WS, update_workspace),
]
