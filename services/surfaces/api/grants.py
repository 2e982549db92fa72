"""Access granted to teams: on the organization, a folder (held by everything inside it)
or a workspace, at read, plan, write or admin (events/teams.py); `none` revokes.

Each change is an event of the organization naming who granted what to whom
(`org.access_granted`, `org.access_revoked`), and holds on every replica from its answer
(every request reads the organization at or past its last event). Granting on the
organization needs its admin; on a folder or a workspace, admin there.

A grant names its workspace by name, and ends with it: a deleted workspace takes no new
grant (409 `workspace-deleted`), and its purge revokes every grant on it
(services/surfaces/api/workspaces.py), so a workspace made again under the name starts
with none. A grant decided on the workspace as it was just before a delete and purge
is checked again once written, and taken back (404) if the workspace it named is gone.
Folders are never deleted (events/folder.py): a folder grant ends only when revoked.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from aiohttp import web

from events import teams as tm
from events.codec import ws_subject
from events.org import OrgState
from events.workspace import WorkspaceState
from infra.eventstore import LATEST
from services.app.aggregates import WORKSPACE
from services.app.execute import Result
from services.surfaces.api.bodies import Body, Name, read_body
from services.surfaces.api.common import (
    Row,
    command_answer,
    items,
    org_state,
    path_id,
    scope,
)
from services.surfaces.api.context import Api
from services.surfaces.api.paths import ORG, WS
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import REF, STR, Doc, list_of, operation

FOLDER = ORG + "/folders/{folder}"


class GrantBody(Body, frozen=True, kw_only=True):
    team: Name
    level: Annotated[str, msgspec.Meta(description="none (revoke), read, plan, write or admin")]


def _target(request: web.Request) -> tuple[str, str]:
    """The grant's target key and the action that changes it, from the path."""
    if "ws" in request.match_info:
        return f"workspace:{path_id(request, 'ws')}", "workspace.access"
    if "folder" in request.match_info:
        return f"folder:{path_id(request, 'folder')}", "workspace.access"
    return "org", "org.access"


def _grants(teams: dict[str, tm.Team], key: str) -> list[Row]:
    """Every team's level on exactly `key` (owners: admin everywhere)."""
    rows = [{"team": tm.OWNERS, "level": "admin"}]
    rows += [
        {"team": t.name, "level": t.access[key]}
        for t in sorted(teams.values(), key=lambda t: t.name)
        if key in t.access and t.name != tm.OWNERS
    ]
    return rows


async def list_grants(request: web.Request) -> web.Response:
    """GET .../access: which teams hold what here (inherited grants not repeated)."""
    key, _ = _target(request)
    reading = "org.read" if key == "org" else "workspace.read"
    api, org, _ = await scope(request, reading)
    state = await org_state(api, org)
    if key.startswith("folder:") and key[7:] not in state.folders:
        raise Problem("not-found", f"folder {key[7:]} not found")
    return items(_grants(state.teams, key))


async def put_grant(request: web.Request) -> web.Response:
    """PUT .../access {"team", "level"}: the team's level here (`none` revokes)."""
    key, action = _target(request)
    api, org, who = await scope(request, action)
    body = await read_body(request, GrantBody)
    await org_state(api, org)
    cmd = tm.GrantAccess(actor=who.user, team=body.team, target=key, level=body.level)
    result = await grant(api, org, cmd)
    await api.after_write(result.seq)
    return command_answer({"items": _grants(result.state.teams, key)}, result.seq)


async def grant(api: Api, org: str, cmd: tm.GrantAccess) -> Result[OrgState]:
    """Record a grant (API and UI alike): on a workspace, only while one lives under the
    name (404 none, 409 deleted), and taken back (404) if it was purged meanwhile."""
    kind, _, ws = cmd.target.partition(":")
    if kind != "workspace" or cmd.level == "none":
        return await api.app.org_command(org, cmd)
    life = _life(ws, await _workspace(api, org, ws))
    result = await api.app.org_command(org, cmd)
    if result.events and not _same_life(await _workspace(api, org, ws), life):
        # deleted (and purged) between the check and the write: the grant goes again
        undo = msgspec.structs.replace(cmd, level="none")
        await api.app.org_command(org, undo)
        raise Problem("not-found", f"workspace {ws} not found")
    return result


async def _workspace(api: Api, org: str, ws: str) -> WorkspaceState:
    """The workspace named `ws` as the stream's leader has it."""
    return (await api.app.load(WORKSPACE, ws_subject(org, ws), min_seq=LATEST)).state


def _life(ws: str, state: WorkspaceState) -> int:
    """Which life of its name a live workspace is (its name's purges so far); 404 when
    no workspace has the name, 409 when it is deleted."""
    if not state.exists:
        raise Problem("not-found", f"workspace {ws} not found")
    if state.deleted:
        raise Problem("workspace-deleted", f"workspace {ws} is deleted: it takes no grant")
    return state.purges


def _same_life(state: WorkspaceState, life: int) -> bool:
    return state.exists and not state.deleted and state.purges == life


# ---------------------------------------------------------------- OpenAPI

_GRANT: Doc = {
    "type": "object",
    "required": ["team", "level"],
    "properties": {"team": STR, "level": {"enum": list(tm.LEVELS[1:])}},
}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((GrantBody,), ref_template=REF)[1],
    "Grant": _GRANT,
    "GrantList": list_of("Grant"),
}


def _ops(where: str, params: tuple[str, ...]) -> Doc:
    return {
        "get": operation(
            f"listGrants{where}",
            f"Teams' access on the {where.lower()}",
            (200, "GrantList"),
            params=params,
            errors=(401, 404),
        ),
        "put": operation(
            f"putGrant{where}",
            f"Grant a team a level on the {where.lower()} (none revokes)",
            (200, "GrantList"),
            params=params,
            body="GrantBody",
            errors=(400, 401, 403, 404, 422),
        ),
    }


_O = "/api/v1/orgs/{org}"
PATHS: dict[str, Doc] = {
    _O + "/access": _ops("Organization", ("org",)),
    _O + "/folders/{folder}/access": _ops("Folder", ("org", "folder")),
    _O + "/workspaces/{ws}/access": _ops("Workspace", ("org", "ws")),
}

ROUTES = [
    web.get(ORG + "/access", list_grants, allow_head=False),
    web.put(ORG + "/access", put_grant),
    web.get(FOLDER + "/access", list_grants, allow_head=False),
    web.put(FOLDER + "/access", put_grant),
    web.get(WS + "/access", list_grants, allow_head=False),
    web.put(WS + "/access", put_grant),
]
