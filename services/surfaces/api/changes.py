"""A run's change review and its per-resource apply states.

`GET .../runs/{run}/changes`: the plan's changes grouped in the order a reviewer reads
them (will be deleted, replaced, updated, created), each group with its count, and a
summary that counts replacements apart (`1 delete · 1 replace · 2 update · 2 create`).
Sensitive values are `(sensitive)`; values known only after apply, `(known after apply)`.

`GET .../runs/{run}/resources`: each resource of the apply with its state (`pending`,
`applying`, `done`, `failed`, `not_applied`) and its stages in the order they ran (a
replacement has two: delete and create, or create and delete).
"""

from __future__ import annotations

from aiohttp import web

from events.values import CHANGE_GROUPS, RESOURCE_STATES
from services.surfaces.api.common import items, json_response, path_id, scope
from services.surfaces.api.paths import RUN
from services.surfaces.api.removed import missing_run
from services.surfaces.api.schemas import BOOL, STR, Doc, ref

_ACTIONS = [action for action, _ in CHANGE_GROUPS]


async def run_changes(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "workspace.read")
    run_id = path_id(request, "run")
    review = await api.read.runs.changes(org, run_id)
    if review is None:
        raise await missing_run(api, org, run_id)
    return json_response(review)


async def run_resources(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "workspace.read")
    run_id = path_id(request, "run")
    if await api.read.runs.get(org, run_id) is None:
        raise await missing_run(api, org, run_id)
    return items(await api.read.runs.resources(org, run_id))


# ---------------------------------------------------------------- OpenAPI

_INT = {"type": "integer", "minimum": 0}
_VALUE: Doc = {"description": 'any JSON value; "(sensitive)" or "(known after apply)" in place'}


def _obj(required: list[str], **props: Doc) -> Doc:
    return {"type": "object", "required": required, "properties": props}


def _nullable(schema: Doc) -> Doc:
    return {"anyOf": [schema, {"type": "null"}]}


SCHEMAS: dict[str, Doc] = {
    "AttributeChange": _obj(
        ["name", "before", "after", "forces_replacement"],
        name=STR,
        before=_VALUE,
        after=_VALUE,
        forces_replacement=BOOL,
    ),
    "ResourceChange": _obj(
        ["address", "type", "module", "action", "attributes", "replace_paths"],
        address={**STR, "examples": ["module.net.aws_instance.web[0]"]},
        type=STR,
        module={**_nullable(STR), "description": "e.g. module.net; null at the root"},
        action={"enum": _ACTIONS},
        attributes={"type": "array", "items": ref("AttributeChange")},
        replace_paths={
            "type": "array",
            "items": {**STR, "examples": ["ami", "tags.name"]},
            "description": "the attributes that force a replacement",
        },
    ),
    "ChangeReview": _obj(
        ["summary", "summary_text", "groups"],
        summary=_obj(_ACTIONS, **{a: _INT for a in _ACTIONS}),
        summary_text={**STR, "examples": ["1 delete · 1 replace · 2 update · 2 create"]},
        groups={
            "type": "array",
            "description": "non-empty groups in the order delete, replace, update, create",
            "items": _obj(
                ["action", "title", "count", "items"],
                action={"enum": _ACTIONS},
                title={"enum": [title for _, title in CHANGE_GROUPS]},
                count=_INT,
                items={"type": "array", "items": ref("ResourceChange")},
            ),
        },
    ),
    "ResourceState": _obj(
        ["address", "action", "state", "error", "stages"],
        address=STR,
        action={**STR, "description": "the planned action: create, update, delete, replace"},
        state={"enum": list(RESOURCE_STATES)},
        error={**_nullable(STR), "description": "Terraform's error when the resource failed"},
        stages={
            "type": "array",
            "description": "in the order they ran; two for a replacement",
            "items": _obj(["action", "state"], action=STR, state={"enum": list(RESOURCE_STATES)}),
        },
    ),
    "ResourceStateList": _obj(["items"], items={"type": "array", "items": ref("ResourceState")}),
}


def _get(op_id: str, summary: str, answer: str) -> Doc:
    return {
        "get": {
            "operationId": op_id,
            "summary": summary,
            "parameters": [
                {"$ref": f"#/components/parameters/{name}"} for name in ("org", "run", "min_seq")
            ],
            "responses": {
                "200": {
                    "description": answer,
                    "content": {"application/json": {"schema": ref(answer)}},
                },
                **{
                    str(code): {"$ref": f"#/components/responses/{code}"}
                    for code in (400, 401, 404, 410, 422, 503)
                },
            },
        }
    }


PATHS: dict[str, Doc] = {
    "/api/v1/orgs/{org}/runs/{run}/changes": _get(
        "runChanges", "The plan's changes, grouped for review", "ChangeReview"
    ),
    "/api/v1/orgs/{org}/runs/{run}/resources": _get(
        "runResources", "Each resource's state during the apply", "ResourceStateList"
    ),
}


ROUTES = [
    web.get(RUN + "/changes", run_changes, allow_head=False),
    web.get(RUN + "/resources", run_resources, allow_head=False),
]
