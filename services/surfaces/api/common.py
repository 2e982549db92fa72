"""Helpers every handler shares: path ids, access checks, JSON answers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import structlog
from aiohttp import web

from events import access
from events.errors import NotFound
from events.org import OrgState
from services.surfaces.api.auth import PRINCIPAL, Principal
from services.surfaces.api.bodies import check_name
from services.surfaces.api.context import API, Api
from services.surfaces.api.problems import Problem

log = structlog.get_logger("runplane.api")

SEQ_HEADER = "RP-Seq"
Row = dict[str, Any]
_encoder = msgspec.json.Encoder()


def json_response(
    data: Any, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=_encoder.encode(data),
        content_type="application/json",
        headers=dict(headers or {}),
    )


def items(rows: list[Row], **extra: Any) -> web.Response:
    return json_response({"items": rows, **extra})


def path_id(request: web.Request, key: str) -> str:
    """A validated id from the path (org, ws, run): they become NATS subject tokens."""
    return check_name(key, request.match_info[key])


async def scope(request: web.Request, action: str, *, ws: str = "") -> tuple[Api, str, Principal]:
    """The api, the path's organization and the caller, once the caller may do `action`
    (events/access.py) on its target: the workspace `ws`, else the path's workspace, the
    run's workspace, the folder, else the organization. 404 for another organization and
    for a workspace or run the caller may not read, 403 when it lacks the level."""
    org = path_id(request, "org")
    who = request[PRINCIPAL]
    api = request.app[API]
    target, hidden = await target_of(api, who, org, action, request.match_info, ws=ws)
    access.require(who.access, action, target, hidden=hidden)
    return api, org, who


async def target_of(
    api: Api, who: Principal, org: str, action: str, match: Mapping[str, str], *, ws: str = ""
) -> tuple[access.Target, str]:
    """What `action` is on, and how to name it when hidden. Nothing is looked up when the
    caller's level is the same on every workspace (an organization token, owners)."""
    need = access.ACTIONS[action]
    if need.on != "workspace" or who.org != org or who.access.uniform(need.level):
        return access.Target(org=org), ""
    hidden = ""
    if not ws and "ws" in match:
        ws = check_name("ws", match["ws"])
    if not ws and "run" in match:
        run_id = check_name("run", match["run"])
        hidden = f"run {run_id}"
        ws = await run_workspace(api, org, run_id)
    if ws:
        return await workspace_target(api, org, ws), hidden
    if "folder" in match:
        return access.Target(org=org, folders=(check_name("folder", match["folder"]),)), ""
    return access.Target(org=org), ""


async def run_workspace(api: Api, org: str, run_id: str) -> str:
    """The run's workspace: from the read model, else the run's own events (a run just
    created through another replica); NotFound if there is no such run."""
    ws = await api.read.runs.workspace_of(org, run_id)
    if ws is None:
        state = (await api.app.load_run(org, None, run_id)).state
        if not state.exists:
            raise NotFound(f"run {run_id} not found")
        ws = state.workspace
    return ws


async def workspace_target(api: Api, org: str, ws: str) -> access.Target:
    """A workspace as the access check sees it: with its folder (fixed at creation)."""
    folder = await api.read.workspaces.folder_of(org, ws)
    if folder is None:  # not projected here yet, or no such workspace
        folder = (await api.app.load_ws(org, ws)).state.folder
    return access.Target(org=org, workspace=ws, folders=(folder,) if folder else ())


async def may_on(api: Api, who: Principal, org: str, action: str, ws: str) -> bool:
    """Whether the caller may also do `action` on workspace `ws` (a second question of a
    handler that passed `scope`, e.g. an unlock by an admin)."""
    need = access.ACTIONS[action]
    if who.access.uniform(need.level):
        return who.may(action, access.Target(org=org))
    return who.may(action, await workspace_target(api, org, ws))


async def require_on(api: Api, who: Principal, org: str, action: str, ws: str) -> None:
    """`access.require` of `action` on workspace `ws`."""
    need = access.ACTIONS[action]
    if who.access.uniform(need.level) and who.may(action, access.Target(org=org)):
        return
    access.require(who.access, action, await workspace_target(api, org, ws))


def may_read(who: Principal, org: str, ws: str, folder: str) -> bool:
    """Whether the caller may see a workspace (a list's filter: no read per row)."""
    target = access.Target(org=org, workspace=ws, folders=(folder,) if folder else ())
    return who.may("workspace.read", target)


async def readable(api: Api, who: Principal, org: str) -> Callable[[str], bool]:
    """Whether the caller may read a workspace of `org`, by name (one read for all; a
    name no workspace has is judged without folder grants)."""
    if who.access.uniform(access.READ):
        return lambda _: True
    folders = await api.read.workspaces.folders(org)
    return lambda ws: may_read(who, org, ws, folders.get(ws) or "")


async def org_state(api: Api, org: str) -> OrgState:
    """The organization's aggregate (folders, groups, settings, templates, policies):
    404 if it does not exist."""
    state: OrgState = (await api.app.load_org(org)).state
    if not state.exists:
        raise Problem("not-found", f"organization {org} not found")
    return state


def command_answer(row: Row, seq: int, *, status: int = 200, location: str = "") -> web.Response:
    """A command's answer from its own result: the row, RP-Seq, and a Location if given."""
    headers = {SEQ_HEADER: str(seq)}
    if location:
        headers["Location"] = location
    return json_response(row, status=status, headers=headers)


async def written(
    api: Api,
    seq: int,
    fresh: Callable[[], Awaitable[Row | None]],
    fallback: Callable[[], Row],
    *,
    status: int,
    location: str = "",
) -> web.Response:
    """Answer a command: the projected resource once the projection holds the write.

    `fresh` reads the projection; `fallback` renders the command's own result, used only
    when the projection lags beyond the bound (the write stands: answering an error would
    invite a retry that writes twice).
    """
    body = None
    if await api.after_write(seq):
        try:
            body = await fresh()
        except Exception as e:  # noqa: BLE001 - e.g. NATS gone right after the append
            # The write stands whatever failed while reading it back: answer it anyway.
            log.warning("written_answer_fallback", seq=seq, error=repr(e))
    headers = {SEQ_HEADER: str(seq)}
    if location:
        headers["Location"] = location
    return json_response(body if body is not None else fallback(), status=status, headers=headers)
