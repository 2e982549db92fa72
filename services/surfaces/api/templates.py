"""Run templates (`events/templates.py`): the built-ins and the organization's own.

`PUT .../templates/{name}` `{"steps": [{"number", "kind", "name"?, "command"?, "always"?}, ...]}`
saves one (admin; a rule it breaks is 422 `invalid-command` with the reason), `GET
.../templates` lists the built-ins (`builtin: true`) then the organization's own, `GET
.../templates/{name}` answers one, `DELETE` removes one of the organization's (a built-in
cannot be deleted). Read from the organization aggregate, not the read model. A run
records the steps it was created with, so changing or deleting a template changes no run.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from aiohttp import web

from events import templates as te
from events.org import OrgState
from services.surfaces.api.bodies import Body, read_body
from services.surfaces.api.common import (
    SEQ_HEADER,
    Row,
    command_answer,
    items,
    json_response,
    org_state,
    path_id,
    scope,
)
from services.surfaces.api.paths import ORG
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import (
    BOOL,
    INT,
    REF,
    SEQ_DOC,
    STR,
    Doc,
    list_of,
    ok,
    path_param,
    problems,
    ref,
)

PREFIX = "/api/v1/orgs"

_STEP_DOC: Doc = {
    "type": "object",
    "required": ["number", "kind"],
    "additionalProperties": False,
    "properties": {
        "number": {**INT, "minimum": 1, "maximum": 99999, "description": "steps run in order"},
        "kind": {"enum": list(te.KINDS)},
        "name": {**STR, "maxLength": 100, "description": "shown in the run (default: kind)"},
        "command": {
            **STR,
            "maxLength": te.MAX_COMMAND,
            "description": "custom steps only: one shell line run with /bin/sh -c in the "
            "workspace's directory of the checkout",
        },
        "always": {
            **BOOL,
            "default": False,
            "description": "custom steps only: a step after the apply or destroy step runs "
            "only if that step ran (not after a plan with no changes) unless this is true; "
            "its command then reads RUNPLANE_APPLIED (true or false)",
        },
    },
}


class TemplateBody(Body, frozen=True, kw_only=True):
    steps: Annotated[
        list[Any],
        msgspec.Meta(
            description="the steps, numbered (plan 100, policy 125, approval 150, apply 200)",
            extra_json_schema={"items": _STEP_DOC, "minItems": 1, "maxItems": te.MAX_STEPS},
        ),
    ]


def row(template: te.Template) -> Row:
    return {
        "name": template.name,
        "builtin": template.builtin,
        "steps": [
            {
                "number": s.number,
                "kind": s.kind,
                "name": s.label,
                "command": s.command or None,
                "always": s.always,
            }
            for s in template.steps
        ],
    }


def _find(state: OrgState, name: str) -> te.Template:
    template = te.BUILTIN.get(name) or state.templates.get(name)
    if template is None:
        raise Problem("not-found", f"template {name} not found")
    return template


async def list_templates(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "org.read")
    state = await org_state(api, org)
    return items([row(t) for t in (*te.BUILTIN.values(), *state.templates.values())])


async def get_template(request: web.Request) -> web.Response:
    api, org, _ = await scope(request, "org.read")
    name = path_id(request, "template")
    return json_response(row(_find(await org_state(api, org), name)))


async def put_template(request: web.Request) -> web.Response:
    """Create or replace one of the organization's templates: 201 if new, else 200."""
    api, org, who = await scope(request, "org.settings")
    name = path_id(request, "template")
    body = await read_body(request, TemplateBody)
    before = await org_state(api, org)
    steps = te.parse_steps(body.steps)  # Invalid (422) with the reason
    result = await api.app.org_command(org, te.SaveTemplate(actor=who.user, name=name, steps=steps))
    new = name not in before.templates
    answer = row(result.state.templates[name])
    where = f"{PREFIX}/{org}/templates/{name}" if new else ""
    return command_answer(answer, result.seq, status=201 if new else 200, location=where)


async def delete_template(request: web.Request) -> web.Response:
    api, org, who = await scope(request, "org.settings")
    name = path_id(request, "template")
    await org_state(api, org)
    if name in te.BUILTIN:
        raise Problem("invalid-command", f"{name!r} is a built-in template: it cannot be deleted")
    result = await api.app.org_command(org, te.DeleteTemplate(actor=who.user, name=name))
    return web.Response(status=204, headers={SEQ_HEADER: str(result.seq)})


# ---------------------------------------------------------------- OpenAPI

_TEMPLATE: Doc = {
    "type": "object",
    "required": ["name", "builtin", "steps"],
    "properties": {
        "name": STR,
        "builtin": {**BOOL, "description": "one of runplane's (cannot be changed)"},
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["number", "kind", "name", "command", "always"],
                "properties": {
                    "number": INT,
                    "kind": {"enum": list(te.KINDS)},
                    "name": STR,
                    "command": {"type": ["string", "null"]},
                    "always": BOOL,
                },
            },
        },
    },
}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((TemplateBody,), ref_template=REF)[1],
    "Template": _TEMPLATE,
    "TemplateList": list_of("Template"),
}
PARAMETERS: dict[str, Doc] = {"template": path_param("template", "template name")}
_PARAMS = [{"$ref": f"#/components/parameters/{p}"} for p in ("org", "template")]


PATHS: dict[str, Doc] = {
    "/api/v1/orgs/{org}/templates": {
        "get": {
            "operationId": "listTemplates",
            "summary": "The built-in templates, then the organization's own",
            "parameters": _PARAMS[:1],
            "responses": {"200": ok("TemplateList"), **problems(404, 422)},
        },
    },
    "/api/v1/orgs/{org}/templates/{template}": {
        "get": {
            "operationId": "getTemplate",
            "summary": "A template, built-in or the organization's",
            "parameters": _PARAMS,
            "responses": {"200": ok("Template"), **problems(404, 422)},
        },
        "put": {
            "operationId": "putTemplate",
            "summary": "Create (201) or replace (200) a template; a broken rule is 422 "
            "with the reason",
            "parameters": _PARAMS,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ref("TemplateBody")}},
            },
            "responses": {
                "200": ok("Template", seq=True),
                "201": ok("Template", seq=True),
                **problems(400, 403, 404, 422),
            },
        },
        "delete": {
            "operationId": "deleteTemplate",
            "summary": "Delete one of the organization's templates (not a built-in); runs "
            "keep the steps they recorded",
            "parameters": _PARAMS,
            "responses": {
                "204": {"description": "deleted", "headers": {"RP-Seq": SEQ_DOC}},
                **problems(403, 404, 422),
            },
        },
    },
}


ROUTES = [
    web.get(ORG + "/templates", list_templates, allow_head=False),
    web.get(ORG + "/templates/{template}", get_template, allow_head=False),
    web.put(ORG + "/templates/{template}", put_template),
    web.delete(ORG + "/templates/{template}", delete_template),
]
