"""Secret variables of a workspace: set and removed one by one, shown only by name.

Values go straight into the sealed store (`services/app/secrets.py`); no event, projection row
or answer ever holds one. `GET .../workspaces/{ws}` lists the names, each `(sensitive)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import msgspec
from aiohttp import web

from events.run import Workspace
from events.values import SENSITIVE
from events.workspace import WorkspaceState
from services.app.execute import Result
from services.app.secrets import MAX_VALUE, NAME_RE, SecretStore, valid_name
from services.surfaces.api import render
from services.surfaces.api.bodies import Body, read_body
from services.surfaces.api.common import Row, json_response, path_id, scope, written
from services.surfaces.api.context import Api
from services.surfaces.api.paths import WS
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import REF, STR, Doc, problems, ref

SECRETS: web.AppKey[SecretStore] = web.AppKey("runplane.secrets", SecretStore)

SecretValue = Annotated[str, msgspec.Meta(max_length=MAX_VALUE, description="the clear value")]


class SetSecretBody(Body, frozen=True, kw_only=True):
    value: SecretValue


def check_secret_names(names: Mapping[str, str], plain: Mapping[str, str]) -> None:
    """Terraform variable names, none of them also a plain variable."""
    for name in names:
        if not valid_name(name):
            raise Problem(
                "invalid-command",
                f"secret variable name {name!r} is not a Terraform variable name",
            )
        if name in plain:
            raise _conflict(f"{name!r} is both a variable and a secret variable")


def _conflict(detail: str) -> Problem:
    """A plain variable would shadow a secret one (Terraform takes `-var` / tfvars over
    `TF_VAR_*`, so the secret would silently not be used), or the other way round."""
    return Problem("invalid-command", detail)  # the type it always had on create


async def check_plain_names(
    request: web.Request, org: str, ws: str, plain: Mapping[str, str]
) -> None:
    """No plain variable may take the name of one of the workspace's secret variables."""
    store = request.app.get(SECRETS)
    if store is None or not plain:
        return  # without the sealed store there are no secret variables
    clash = sorted(set(plain) & set(await store.names(org, ws)))
    if clash:
        names = ", ".join(repr(n) for n in clash)
        raise _conflict(f"{names}: a secret variable of workspace {ws} already has that name")


def store_of(request: web.Request) -> SecretStore:
    store = request.app.get(SECRETS)
    if store is None:
        raise Problem("unavailable", "secret variables need the encryption key; this api has none")
    return store


async def store_all(request: web.Request, org: str, ws: str, values: Mapping[str, str]) -> None:
    """Seal and store a new workspace's secret variables."""
    if not values:
        return
    store = store_of(request)
    for name, value in values.items():
        await store.put(org, ws, name, value)


async def workspace_shown(request: web.Request, api: Api, org: str, ws: str) -> Row | None:
    """A workspace as answered: its secret variables by name only, each `(sensitive)`."""
    row = await api.read.workspaces.get(org, ws)
    store = request.app.get(SECRETS)
    if row is None or store is None:
        return row
    names = await store.names(org, ws)
    return {**row, "secret_variables": dict.fromkeys(names, SENSITIVE)}


async def _existing_workspace(api: Api, org: str, ws: str) -> Workspace:
    state = (await api.app.load_ws(org, ws)).state
    config: Workspace | None = state.config
    if config is None:
        raise Problem("not-found", f"workspace {ws} not found")
    if state.deleted:
        raise Problem("workspace-deleted", f"workspace {ws} was deleted")
    return config


async def workspace_written(
    request: web.Request,
    api: Api,
    org: str,
    ws: str,
    result: Result[WorkspaceState],
    user: str,
    *,
    status: int = 200,
    location: str = "",
) -> web.Response:
    """Answer a workspace command with the workspace as shown (secret names included)."""
    return await written(
        api,
        result.seq,
        lambda: workspace_shown(request, api, org, ws),
        lambda: render.workspace(result.state, user),
        status=status,
        location=location,
    )


def _name(request: web.Request) -> str:
    name = request.match_info["name"]
    if not valid_name(name):
        raise Problem("invalid-id", f"{name!r} is not a Terraform variable name")
    return name


async def put_secret(request: web.Request) -> web.Response:
    """PUT .../secret-variables/{name} {"value": ...}: set one secret variable."""
    api, org, _ = await scope(request, "variables.write")
    ws, name = path_id(request, "ws"), _name(request)
    body = await read_body(request, SetSecretBody)
    store = store_of(request)
    config = await _existing_workspace(api, org, ws)
    if name in config.variables:  # the aggregate, not the read model: it may lag a PATCH
        raise _conflict(f"{name!r} is a plain variable of workspace {ws}")
    await store.put(org, ws, name, body.value)
    return json_response({"name": name, "value": SENSITIVE})


async def delete_secret(request: web.Request) -> web.Response:
    """DELETE .../secret-variables/{name}: remove one secret variable."""
    api, org, _ = await scope(request, "variables.write")
    ws, name = path_id(request, "ws"), _name(request)
    store = store_of(request)
    await _existing_workspace(api, org, ws)
    if not await store.delete(org, ws, name):
        raise Problem("not-found", f"workspace {ws} has no secret variable {name}")
    return web.Response(status=204)


# ---------------------------------------------------------------- OpenAPI

PARAMETERS: dict[str, Doc] = {
    "name": {
        "name": "name",
        "in": "path",
        "required": True,
        "description": "secret variable name (a Terraform variable name)",
        "schema": {**STR, "pattern": NAME_RE.pattern},
    },
}
_PARAMS = [{"$ref": f"#/components/parameters/{p}"} for p in ("org", "ws", "name")]
_ERR = problems(403, 404, 422)
SCHEMAS: dict[str, Doc] = {
    "SecretVariable": {
        "type": "object",
        "required": ["name", "value"],
        "properties": {"name": STR, "value": {"const": SENSITIVE}},
    },
    **msgspec.json.schema_components((SetSecretBody,), ref_template=REF)[1],
}
PATHS: dict[str, Doc] = {
    "/api/v1/orgs/{org}/workspaces/{ws}/secret-variables/{name}": {
        "put": {
            "operationId": "setSecretVariable",
            "summary": "Set a secret variable (stored sealed; never shown again)",
            "parameters": _PARAMS,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ref("SetSecretBody")}},
            },
            "responses": {
                "200": {
                    "description": "SecretVariable",
                    "content": {"application/json": {"schema": ref("SecretVariable")}},
                },
                "400": {"$ref": "#/components/responses/400"},
                **_ERR,
            },
        },
        "delete": {
            "operationId": "deleteSecretVariable",
            "summary": "Remove a secret variable",
            "parameters": _PARAMS,
            "responses": {"204": {"description": "removed"}, **_ERR},
        },
    },
}


ROUTES = [
    web.put(WS + "/secret-variables/{name}", put_secret),
    web.delete(WS + "/secret-variables/{name}", delete_secret),
]
