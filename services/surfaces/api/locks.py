"""Workspace locks: a person stops admission on a workspace, with a reason, until unlocked.

While a workspace is locked its runs are still created and wait `pending`; a run already
past `pending` carries on. Unlocking lets the scheduler admit the oldest waiting run. The
lock's holder, reason and time show in `GET .../workspaces/{ws}` (`lock`), and every lock
and unlock is an event (`ws.locked`, `ws.unlocked`) with its actor and time.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from aiohttp import web

from services.surfaces.api import secrets
from services.surfaces.api.bodies import Body, read_body
from services.surfaces.api.common import may_on, path_id, scope
from services.surfaces.api.paths import WS
from services.surfaces.api.schemas import REF, Doc, operation


class LockBody(Body, frozen=True, kw_only=True):
    reason: Annotated[
        str, msgspec.Meta(min_length=1, max_length=1024, description="why it is locked")
    ]


class UnlockBody(Body, frozen=True, kw_only=True):
    """No fields: unlocking needs no reason (the lock's own is kept with the event)."""


async def lock_workspace(request: web.Request) -> web.Response:
    """POST .../workspaces/{ws}/lock {"reason": ...}: 409 if it is locked already."""
    api, org, who = await scope(request, "workspace.lock")
    ws = path_id(request, "ws")
    body = await read_body(request, LockBody)
    result = await api.app.lock_workspace(org, ws, body.reason, who.user)
    return await secrets.workspace_written(request, api, org, ws, result, who.user)


async def unlock_workspace(request: web.Request) -> web.Response:
    """POST .../workspaces/{ws}/unlock: the holder or an org admin; 409 if not locked."""
    api, org, who = await scope(request, "workspace.lock")
    ws = path_id(request, "ws")
    await read_body(request, UnlockBody, optional=True)
    admin = await may_on(api, who, org, "workspace.force_unlock", ws)
    result = await api.app.unlock_workspace(org, ws, who.user, admin=admin)
    return await secrets.workspace_written(request, api, org, ws, result, who.user)


# ---------------------------------------------------------------- OpenAPI

SCHEMAS: dict[str, Doc] = msgspec.json.schema_components((LockBody, UnlockBody), ref_template=REF)[
    1
]


def _op(op_id: str, summary: str, body: str, required: bool) -> Doc:
    return operation(
        op_id,
        summary,
        (200, "Workspace"),
        params=("org", "ws"),
        body=body,
        body_required=required,
        errors=(400, 403, 404, 409, 422),
    )


PATHS: dict[str, Doc] = {
    "/api/v1/orgs/{org}/workspaces/{ws}/lock": {
        "post": _op(
            "lockWorkspace",
            "Lock the workspace: runs queue but none is admitted (409 if locked)",
            "LockBody",
            True,
        )
    },
    "/api/v1/orgs/{org}/workspaces/{ws}/unlock": {
        "post": _op(
            "unlockWorkspace",
            "Unlock the workspace (its holder or an org admin); the oldest run is admitted",
            "UnlockBody",
            False,
        )
    },
}


ROUTES = [
    web.post(WS + "/lock", lock_workspace),
    web.post(WS + "/unlock", unlock_workspace),
]
