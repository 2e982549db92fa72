"""Folders and inherited settings: organization -> folders (nested) -> workspace.

Reads come from the organization and workspace aggregates themselves (a few events on two
subjects), so they always include the caller's own writes. Every write is an admin's.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from events import access, inherit
from events import folder as fo
from events import settings as st
from events import templates as te
from events.errors import Invalid
from events.org import OrgState
from events.workspace import WorkspaceState
from services.surfaces.api import asof
from services.surfaces.api.bodies import CreateFolderBody, check_name, decode_as, read_body
from services.surfaces.api.common import (
    Row,
    command_answer,
    items,
    json_response,
    org_state,
    path_id,
    scope,
)
from services.surfaces.api.context import Api
from services.surfaces.api.paths import ORG, WS
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import BOOL, INT, STR, Doc, list_of, operation, path_param, ref

PREFIX = "/api/v1/orgs"


def _folder_of(request: web.Request, state: OrgState) -> str:
    name = path_id(request, "folder")
    if name not in state.folders:
        raise Problem("not-found", f"folder {name} not found")
    return name


async def _workspace(api: Api, org: str, ws: str) -> WorkspaceState:
    state: WorkspaceState = (await api.app.load_ws(org, ws)).state
    if not state.exists:
        raise Problem("not-found", f"workspace {ws} not found")
    return state


async def _changes(request: web.Request, org: OrgState, *, own: bool = False) -> dict[str, Any]:
    """The PATCH body: a JSON object of settings, each checked, every problem named; the
    templates the `templates` setting names exist in the organization (or are built in)
    and suit their run type."""
    prefix = "a JSON object of settings is required: "
    changes = decode_as(await request.read(), dict[str, Any], prefix)
    reasons = []
    for name, value in changes.items():
        try:
            st.validate({name: value}, org=own)
        except Invalid as e:
            reasons.append(str(e))
    if reasons:
        raise Problem("invalid-command", "; ".join(reasons), reasons=reasons)
    reasons = _template_problems(changes.get("templates"), org)
    if reasons:
        raise Problem("invalid-command", "; ".join(reasons), reasons=reasons)
    return changes


def _template_problems(chosen: Any, org: OrgState) -> list[str]:
    """What is wrong with the templates a (valid) `templates` setting names."""
    reasons = []
    for run_type, name in (chosen or {}).items():
        template = te.BUILTIN.get(name) or org.templates.get(name)
        if template is None:
            reasons.append(f"templates: no template {name!r} (for {run_type} runs) exists")
        elif problem := te.compatible(template, run_type):
            reasons.append(f"templates: {problem}")
    return reasons


# ---------------------------------------------------------------- folders


def _folder_row(state: OrgState, name: str) -> Row:
    folder = state.folders[name]
    return {
        "name": name,
        "parent": folder.parent or None,
        "path": fo.path(state.folders, name),
        "settings": folder.settings,
    }


async def create_folder(request: web.Request) -> web.Response:
    """POST .../folders: `manage-workspaces` (or an org admin), or admin on its parent."""
    api, org, who = await scope(request, "org.read")
    body = await read_body(request, CreateFolderBody)
    name = check_name("name", body.name)
    parent = check_name("parent", body.parent) if body.parent else ""
    if not (parent and who.may("workspace.settings", access.Target(org=org, folders=(parent,)))):
        await scope(request, "folders.create")
    await org_state(api, org)
    cmd = fo.CreateFolder(actor=who.user, name=name, parent=parent)
    result = await api.app.org_command(org, cmd)
    where = f"{PREFIX}/{org}/folders/{name}"
    return command_answer(_folder_row(result.state, name), result.seq, status=201, location=where)


async def list_folders(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "org.read")
    state = await org_state(api, org)
    return items([_folder_row(state, name) for name in state.folders])


# ---------------------------------------------------------------- settings


def _org_settings(state: OrgState) -> Row:
    return {"settings": state.settings, "effective": inherit.for_org(state)}


def _folder_settings(state: OrgState, name: str) -> Row:
    return {**_folder_row(state, name), "effective": inherit.for_folder(state, name)}


def _workspace_settings(org: OrgState, ws: WorkspaceState) -> Row:
    """The same shape as the other levels: what the workspace sets itself (its
    configuration's timeouts included), and every effective value with its origin."""
    return {
        "name": ws.name,
        "folder": ws.folder or None,
        "settings": inherit.workspace_own(ws),
        "effective": inherit.for_workspace(org, ws),
    }


async def get_org_settings(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "org.read")
    return json_response(_org_settings(await org_state(api, org)))


async def patch_org_settings(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.settings")
    changes = await _changes(request, await org_state(api, org), own=True)
    result = await api.app.org_command(org, fo.SetOrgSettings(actor=who.user, changes=changes))
    return command_answer(_org_settings(result.state), result.seq)


async def get_folder_settings(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "workspace.read")
    state = await org_state(api, org)
    return json_response(_folder_settings(state, _folder_of(request, state)))


async def patch_folder_settings(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "workspace.settings")
    state = await org_state(api, org)
    name = _folder_of(request, state)
    changes = await _changes(request, state)
    cmd = fo.SetFolderSettings(actor=who.user, folder=name, changes=changes)
    result = await api.app.org_command(org, cmd)
    return command_answer(_folder_settings(result.state, name), result.seq)


async def get_workspace_settings(request: web.Request) -> web.Response:
    """The workspace's own settings and every effective value, with its origin."""
    api, org, _ = await scope(request, "workspace.read")
    ws = path_id(request, "ws")
    if asof.asked(request):  # as answered then (services/surfaces/api/asof.py)
        org_then, ws_then, seq = await asof.aggregates(request, org, ws)
        return asof.answer(_workspace_settings(org_then, ws_then), seq)
    state = await org_state(api, org)
    return json_response(_workspace_settings(state, await _workspace(api, org, ws)))


async def patch_workspace_settings(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "workspace.settings")
    ws = path_id(request, "ws")
    state = await org_state(api, org)
    await _workspace(api, org, ws)
    changes = await _changes(request, state)
    result = await api.app.set_workspace_settings(org, ws, changes, who.user)
    return command_answer(_workspace_settings(state, result.state), result.seq)


# ---------------------------------------------------------------- OpenAPI

_TYPES: dict[type, Doc] = {
    bool: BOOL,
    int: {**INT, "minimum": 0},
    str: STR,
    list: {"type": "array", "items": STR},
    dict: {"type": "object", "additionalProperties": STR},
    type(None): {"type": ["integer", "null"], "minimum": 0, "maximum": st.MAX_DAYS},  # days
}


def _setting(spec: st.Spec) -> Doc:
    return {**_TYPES[type(spec.default)], "description": spec.doc, "default": spec.default}


_SETTINGS: Doc = {"type": "object", "properties": {n: _setting(s) for n, s in st.SPECS.items()}}
_ORIGIN = {**STR, "description": "default, org, folder:<name> (the innermost) or workspace"}

SCHEMAS: dict[str, Doc] = {
    "Settings": {**_SETTINGS, "description": "the values one level sets itself"},
    "SettingsPatch": {
        "type": "object",
        "additionalProperties": False,
        "description": "settings to change at this level; null unsets one (422 lists "
        "every unknown setting or bad value)",
        "properties": {n: {"anyOf": [_setting(s), {"type": "null"}]} for n, s in st.SPECS.items()},
    },
    "EffectiveSettings": {
        "type": "object",
        "description": "every setting's effective value and where it comes from",
        "properties": {
            n: {
                "type": "object",
                "required": ["value", "origin"],
                "properties": {"value": _setting(s), "origin": _ORIGIN},
            }
            for n, s in st.SPECS.items()
        },
    },
    "Folder": {
        "type": "object",
        "required": ["name", "parent", "path", "settings"],
        "properties": {
            "name": STR,
            "parent": {"anyOf": [STR, {"type": "null"}]},
            "path": {"type": "array", "items": STR, "description": "outermost first"},
            "settings": ref("Settings"),
        },
    },
    "FolderList": list_of("Folder"),
    "OrgSettings": {
        "type": "object",
        "required": ["settings", "effective"],
        "properties": {"settings": ref("Settings"), "effective": ref("EffectiveSettings")},
    },
    "FolderSettings": {
        "allOf": [
            ref("Folder"),
            {"type": "object", "properties": {"effective": ref("EffectiveSettings")}},
        ]
    },
    "WorkspaceSettings": {
        "type": "object",
        "description": "the same shape as every level: `settings` (its own) and `effective`",
        "required": ["name", "folder", "settings", "effective"],
        "properties": {
            "name": STR,
            "folder": {"anyOf": [STR, {"type": "null"}]},
            "settings": ref("Settings"),
            "effective": ref("EffectiveSettings"),
        },
    },
}


def _op(
    op_id: str,
    summary: str,
    answer: tuple[int, str],
    params: tuple[str, ...],
    body: str = "",
    errors: tuple[int, ...] = (),
) -> Doc:
    return operation(op_id, summary, answer, params=params, body=body, errors=errors)


_W = (400, 403, 404, 422)
_R = (404, 422)
PATHS: dict[str, Doc] = {
    "/api/v1/orgs/{org}/folders": {
        "get": _op(
            "listFolders", "The organization's folders", (200, "FolderList"), ("org",), errors=_R
        ),
        "post": _op(
            "createFolder",
            "Create a folder, nested in `parent` if given",
            (201, "Folder"),
            ("org",),
            "CreateFolderBody",
            (*_W, 409),
        ),
    },
    "/api/v1/orgs/{org}/settings": {
        "get": _op(
            "getOrgSettings",
            "The organization's settings",
            (200, "OrgSettings"),
            ("org",),
            errors=_R,
        ),
        "patch": _op(
            "setOrgSettings",
            "Change the organization's settings",
            (200, "OrgSettings"),
            ("org",),
            "SettingsPatch",
            _W,
        ),
    },
    "/api/v1/orgs/{org}/folders/{folder}/settings": {
        "get": _op(
            "getFolderSettings",
            "A folder's settings",
            (200, "FolderSettings"),
            ("org", "folder"),
            errors=_R,
        ),
        "patch": _op(
            "setFolderSettings",
            "Change a folder's settings",
            (200, "FolderSettings"),
            ("org", "folder"),
            "SettingsPatch",
            _W,
        ),
    },
    "/api/v1/orgs/{org}/workspaces/{ws}/settings": {
        "get": _op(
            "getWorkspaceSettings",
            "The workspace's own settings and every effective one, with its origin",
            (200, "WorkspaceSettings"),
            ("org", "ws", "as_of"),
            errors=_R,
        ),
        "patch": _op(
            "setWorkspaceSettings",
            "Change the workspace's own settings",
            (200, "WorkspaceSettings"),
            ("org", "ws"),
            "SettingsPatch",
            _W,
        ),
    },
}
# as_of: every read that takes it (services/surfaces/api/asof.py), this one's among them
PARAMETERS: dict[str, Doc] = {
    "folder": path_param("folder", "folder name"),
    "as_of": asof.PARAMETER,
}


ROUTES = [
    web.get(ORG + "/folders", list_folders, allow_head=False),
    web.post(ORG + "/folders", create_folder),
    web.get(ORG + "/settings", get_org_settings, allow_head=False),
    web.patch(ORG + "/settings", patch_org_settings),
    web.get(ORG + "/folders/{folder}/settings", get_folder_settings, allow_head=False),
    web.patch(ORG + "/folders/{folder}/settings", patch_folder_settings),
    web.get(WS + "/settings", get_workspace_settings, allow_head=False),
    web.patch(WS + "/settings", patch_workspace_settings),
]
