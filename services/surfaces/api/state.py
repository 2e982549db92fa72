"""A workspace's state versions, newest first, as recorded by `run.state_version` events
(a run wrote it) and `ws.state_pushed` events (a user's CLI pushed it: `pushed_by`).

The versions themselves stay sealed in the object store; this lists what each one is
(serial, lineage, digest, size, object) and which run or user wrote it.
"""

from __future__ import annotations

from aiohttp import web

from services.surfaces.api import asof
from services.surfaces.api.common import items, path_id, scope
from services.surfaces.api.paths import WS
from services.surfaces.api.problems import Problem
from services.surfaces.api.rollback import with_ids
from services.surfaces.api.schemas import BOOL, INT, STR, TIME, Doc, list_of, ref


async def list_state_versions(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "workspace.read")
    ws = path_id(request, "ws")
    if asof.asked(request):  # the versions as listed then (services/surfaces/api/asof.py)
        return await asof.state_versions(request, org, ws)
    if await api.read.workspaces.get(org, ws) is None:
        raise Problem("not-found", f"workspace {ws} not found")
    return items(with_ids(org, ws, await api.read.workspaces.state_versions(org, ws)))


# ---------------------------------------------------------------- OpenAPI

NULL: Doc = {"type": "null"}

SCHEMAS: dict[str, Doc] = {
    "StateVersion": {
        "type": "object",
        "required": ["serial", "lineage", "digest", "object", "size", "run_id", "created_at"],
        "properties": {
            "id": {**STR, "description": "what `.../state-versions/{id}/rollback` takes"},
            "serial": INT,
            "lineage": STR,
            "digest": {**STR, "description": "sha256 of the clear state"},
            "object": {**STR, "description": "sealed object in rp-state"},
            "size": {**INT, "description": "bytes of the clear state"},
            "run_id": {"anyOf": [STR, NULL], "description": "null: a user's CLI pushed it"},
            "created_at": TIME,
            "recovered": {**BOOL, "description": "left by a dead executor, recorded at restart"},
            "pushed_by": {
                "anyOf": [STR, NULL],
                "description": "the user whose Terraform CLI pushed it (null: a run wrote it)",
            },
            "forced": {**BOOL, "description": "pushed with `terraform state push -force`"},
            "rollback_of": {
                "anyOf": [STR, NULL],
                "description": "a rollback: the version (object) whose content it copies",
            },
            "reason": {"anyOf": [STR, NULL], "description": "a rollback: why, as its admin said"},
        },
    },
}
SCHEMAS["StateVersionList"] = list_of("StateVersion")
PATHS: dict[str, Doc] = {
    "/api/v1/orgs/{org}/workspaces/{ws}/state-versions": {
        "get": {
            "operationId": "listStateVersions",
            "summary": "The workspace's state versions, newest first",
            "parameters": [
                {"$ref": f"#/components/parameters/{p}"} for p in ("org", "ws", "min_seq", "as_of")
            ],
            "responses": {
                "200": {
                    "description": "StateVersionList",
                    "content": {"application/json": {"schema": ref("StateVersionList")}},
                },
                **{
                    str(c): {"$ref": f"#/components/responses/{c}"}
                    for c in (400, 401, 404, 422, 503)
                },
            },
        }
    },
}


ROUTES = [
    web.get(WS + "/state-versions", list_state_versions, allow_head=False),
]
